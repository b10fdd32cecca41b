"""Block-scaled fp8 grouped matmul of DeepSeek-V4's output projection (wo_a), sm80/86/89.

Replaces DeepGEMM's `fp8_einsum("bhr,hdr->bhd", ...)` with the sm90 recipe (1, 128, 128),
which vLLM's `deep_gemm_fp8_o_proj` runs on the inverse-RoPE quant's output; DeepGEMM
runs on sm90/sm100 only.

Semantics, the reference being `fp8_einsum_reference`:
- x [T, G, R] fp8 e4m3 with x_scale [T, G, R / 128] fp32: one scale a token and 128 of
  its dims, as `fused_inv_rope_fp8_quant` writes them (any strides);
- w [G, D, R] fp8 e4m3 with w_scale [G, ceil(D / 128), R / 128] fp32: one scale a 128 x
  128 block, the checkpoint's;
- out[t, g, d] = sum over r of x[t, g, r] x_scale[t, g, r // 128] w[g, d, r]
  w_scale[g, d // 128, r // 128], written as bf16 into out [T, G, D].

Tiling:
- a program owns BLOCK_T tokens and BLOCK_D output rows of one group, and walks R one
  128-wide scale block a step;
- each step turns both fp8 tiles into dot operands (exact bf16 decoded in software in the
  operand's layout, no fp8 instruction; on sm89 and later the fp8 bytes as they are),
  one dot gives the block's fp32 sums, and the two scales multiply them before they join
  the accumulator, as DeepGEMM promotes its per-block sums;
- a decode step (few tokens) is a read of the weight, far too few tiles to fill the card:
  R is split over several programs a tile (split-K), as many as a model of the busiest
  SM finds cheapest, and the last of them to finish adds the splits' fp32 sums; a
  prefill chunk has tiles enough to fill the card and runs unsplit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels.cuda_module import (
    compiled_blocks_per_sm,
    context_sm_count,
)
from services.engine.backport.kernels.fp8_e4m3 import (
    decode_e4m3_reference,
    dot_operand,
    hardware_fp8_encode,
)
from services.engine.backport.kernels.mqa_logits import as_bytes
from services.engine.backport.kernels.sparse_mla_decode import dot_dtype

SCALE_BLOCK = 128  # the recipe's scale granularity along R (and along D for w)


@dataclass(frozen=True)
class EinsumTiling:
    """Tile sizes and launch shape of one `fp8_einsum` launch."""

    block_t: int
    block_d: int
    num_warps: int
    num_stages: int
    # Programs sharing one output tile's reduction: 0 picks the count of least
    # `split_cost` on the card (`cheapest_split_count`), 1 is no split.
    splits: int = 0


# A split walks at least this many scale blocks of R, more than its start and its sums
# cost (`split_cost`).
MIN_BLOCKS_PER_SPLIT = 2
# `split_cost`'s terms, in steps of one scale block: a program's start and end, and what
# the last program of a split tile spends on each split's sums.
PROGRAM_START_STEPS = 1.0
STEPS_A_SPLIT_SUM = 0.5
# The interpreter's stand-in for a card: a few splits on the tests' small shapes.
INTERPRETER_SMS = 4


def default_tiling(num_tokens: int, fp8_dot: bool = False) -> EinsumTiling:
    """The tiling for T tokens: decode steps read the weight in tiles of about their
    tokens; prefill chunks compute, in square tiles. `fp8_dot`: the tensor cores take the
    fp8 bytes undecoded (sm89 and later)."""
    # One token takes a 16-token tile too: fp32 multiply-adds on the CUDA cores (no padding
    # rows) were at best 2% faster, and up to 1.22x slower, once the tiles were decoded in
    # the dot operands' layout.
    # 64 weight rows a program: 32 or 128 (at 8 warps) were up to 20% slower at 1-8 tokens,
    # and 64-token tiles for 32 tokens up to 1.4x slower than 32-token ones (each program
    # decodes its token rows again, and its split sums are as large).
    if num_tokens <= 16:
        return EinsumTiling(block_t=16, block_d=64, num_warps=4, num_stages=3)
    if num_tokens <= 32:
        return EinsumTiling(block_t=32, block_d=64, num_warps=4, num_stages=3)
    if num_tokens <= 64:
        return EinsumTiling(block_t=64, block_d=64, num_warps=4, num_stages=3)
    # 128 x 64 at 4 warps ran 1.13-1.27x faster than 128 x 128 at 8 warps (H200 in sm80/86
    # mode, 88-132 SMs), once the bytes were decoded in the dot operands' layout; 64 x 64
    # up to 1.3x slower there (at best 5% faster), but 1.08-1.24x faster with fp8 dots
    # (sm89 mode).
    if fp8_dot:
        return EinsumTiling(block_t=64, block_d=64, num_warps=4, num_stages=3)
    return EinsumTiling(block_t=128, block_d=64, num_warps=4, num_stages=3)


def split_cost(splits: int, tiles: int, num_blocks: int, sm_count: int,
               programs_per_sm: int) -> float:
    """A launch's time in steps of one scale block. The busiest SM runs its programs in
    rounds of as many as it holds, each round as long as one program alone (the steps are
    latency-bound, so programs sharing an SM overlap); then a tile's last program adds
    its splits' sums. Fitted to every split count of the decode tilings on 132, 112 and 88
    SMs in sm80/86 mode and on 132 in sm89 mode (docs/kernels-history.md, "Eighteenth
    session"): its picks ran within 15% of the best count's time on every shape, 2% on
    average."""
    rounds = triton.cdiv(triton.cdiv(tiles * splits, sm_count), programs_per_sm)
    sums = STEPS_A_SPLIT_SUM * splits if splits > 1 else 0.0
    return rounds * (triton.cdiv(num_blocks, splits) + PROGRAM_START_STEPS) + sums


def even_split_count(wanted: int, num_blocks: int) -> int:
    """`wanted` splits of R's `num_blocks` scale blocks, or as many as leave each
    MIN_BLOCKS_PER_SPLIT, evened out: the fewest splits of the same length, so that every
    split has blocks to walk."""
    splits = max(1, min(wanted, num_blocks // MIN_BLOCKS_PER_SPLIT))
    return triton.cdiv(num_blocks, triton.cdiv(num_blocks, splits))


@functools.lru_cache(maxsize=4096)  # every launch asks, with a handful of shapes
def cheapest_split_count(tiles: int, num_blocks: int, sm_count: int,
                         programs_per_sm: int) -> int:
    """The fewest splits of least `split_cost` for `tiles` output tiles, each split walking
    at least MIN_BLOCKS_PER_SPLIT of the `num_blocks` scale blocks (and so even: of counts
    with splits of one length, the fewest costs least)."""
    most = max(1, num_blocks // MIN_BLOCKS_PER_SPLIT)
    return min(range(1, most + 1), key=lambda splits: split_cost(
        splits, tiles, num_blocks, sm_count, programs_per_sm))


@triton.jit(do_not_specialize=["splits", "blocks_per_split"])
def _fp8_einsum_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    num_tokens,
    out_dim,
    num_blocks,
    splits,
    blocks_per_split,
    stride_x_token,
    stride_x_group,
    stride_xs_token,
    stride_xs_group,
    stride_xs_block,
    stride_w_group,
    stride_w_row,
    stride_ws_group,
    stride_ws_row,
    stride_ws_block,
    stride_out_token,
    stride_out_group,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FP8_DOT: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
):
    # Row blocks vary fastest, so programs running together share their token tile.
    row_block = tl.program_id(0)
    token_block = tl.program_id(1) // splits
    split = tl.program_id(1) % splits
    group = tl.program_id(2)
    rows = row_block * BLOCK_D + tl.arange(0, BLOCK_D)
    tokens = token_block * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < out_dim
    token_mask = tokens < num_tokens
    dims = tl.arange(0, SCALE_BLOCK)

    x_tile = (x_ptr + group * stride_x_group + tokens.to(tl.int64)[:, None] * stride_x_token
              + dims[None, :])
    w_tile = (w_ptr + group * stride_w_group + rows.to(tl.int64)[:, None] * stride_w_row
              + dims[None, :])
    x_scales = x_scale_ptr + group * stride_xs_group + tokens * stride_xs_token
    w_scales = w_scale_ptr + group * stride_ws_group + (rows // SCALE_BLOCK) * stride_ws_row

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for block in range(split * blocks_per_split,
                       tl.minimum((split + 1) * blocks_per_split, num_blocks)):
        x_raw = tl.load(x_tile + block * SCALE_BLOCK, mask=token_mask[:, None], other=0)
        w_raw = tl.load(w_tile + block * SCALE_BLOCK, mask=row_mask[:, None], other=0)
        x_values = dot_operand(x_raw, DOT_DTYPE, FP8_DOT, FAST_DEQUANT)
        w_values = dot_operand(w_raw, DOT_DTYPE, FP8_DOT, FAST_DEQUANT)
        x_scale = tl.load(x_scales + block * stride_xs_block, mask=token_mask, other=0.0)
        w_scale = tl.load(w_scales + block * stride_ws_block, mask=row_mask, other=0.0)
        sums = tl.dot(x_values, tl.trans(w_values))
        acc += sums * x_scale[:, None] * w_scale[None, :]

    out = (out_ptr + tokens.to(tl.int64)[:, None] * stride_out_token + group * stride_out_group
           + rows[None, :])
    out_mask = token_mask[:, None] & row_mask[None, :]
    if not SPLIT_K:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Each split leaves its fp32 sums in its own slot; the last of the tile's programs
        # to arrive adds the slots in split order (the same result every run), writes the
        # tile and resets the tile's arrival count for the next launch.
        tile = (group * tl.num_programs(1) // splits + token_block) * tl.num_programs(0) + row_block
        slots = (partial_ptr + tile.to(tl.int64) * splits * BLOCK_T * BLOCK_D
                 + tl.arange(0, BLOCK_T)[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :])
        # Padding tokens' rows stay unwritten and unread: a decode step of one token
        # moves one row a split, not BLOCK_T.
        tl.store(slots + split * BLOCK_T * BLOCK_D, acc, mask=token_mask[:, None])
        # acq_rel: this split's sums are visible before its arrival counts, and the last
        # arrival sees every other split's.
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")
        if arrived == splits - 1:
            total = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for other in range(splits):
                total += tl.load(slots + other * BLOCK_T * BLOCK_D, mask=token_mask[:, None],
                                 other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(arrivals_ptr + tile, 0)


# Arrival counts per output tile, zero between launches (the last arrival resets its
# tile's), so a launch needs no memset (a node more in a CUDA graph). One set a stream:
# launches on two streams at once must not share counts.
_arrival_counts: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """At least `tiles` zeroed int32 arrival counts for launches on `device`'s current
    stream, reused across launches."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    counts = _arrival_counts.get((device, stream))
    if counts is None or counts.numel() < tiles:
        counts = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _arrival_counts[(device, stream)] = counts
    return counts


_programs_per_sm: dict[tuple[object, ...], int] = {}


def programs_per_sm(tiling: EinsumTiling, args: tuple[object, ...],
                    constants: dict[str, object]) -> int:
    """Programs of the split-K kernel under `tiling` that one SM keeps resident, as the
    driver reports for the compiled kernel (held to the target's blocks under emulation):
    compiled once per tiling and arch, not launched."""
    key = (tiling, args[0].device, triton.knobs.runtime.override_arch, constants["FP8_DOT"])
    if key not in _programs_per_sm:
        _programs_per_sm[key] = max(1, compiled_blocks_per_sm(_fp8_einsum_kernel, args,
                                                               constants))
    return _programs_per_sm[key]


def fp8_einsum(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    tiling: EinsumTiling | None = None,
) -> torch.Tensor:
    """out [T, G, D] bf16 = the block-scaled "bhr,hdr->bhd" (see module doc); fills and
    returns `out` when given."""
    x, w = as_bytes(x), as_bytes(w)
    if x.dim() != 3 or w.dim() != 3 or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"x must be [T, G, R] and w [G, D, R] with contiguous rows, got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    num_tokens, num_groups, reduce_dim = x.shape
    out_dim = w.shape[1]
    if w.shape[0] != num_groups or w.shape[2] != reduce_dim or reduce_dim % SCALE_BLOCK:
        raise ValueError(f"w must be [G, D, R] = [{num_groups}, D, {reduce_dim}] with R a "
                         f"multiple of {SCALE_BLOCK}, got {tuple(w.shape)}")
    num_blocks = reduce_dim // SCALE_BLOCK
    if x_scale.shape != (num_tokens, num_groups, num_blocks) or x_scale.dtype != torch.float32:
        raise ValueError(f"x_scale must be fp32 [T, G, R / {SCALE_BLOCK}] = "
                         f"{(num_tokens, num_groups, num_blocks)}, got "
                         f"{x_scale.dtype} {tuple(x_scale.shape)}")
    w_scale_shape = (num_groups, triton.cdiv(out_dim, SCALE_BLOCK), num_blocks)
    if w_scale.shape != w_scale_shape or w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be fp32 [G, D / {SCALE_BLOCK}, R / {SCALE_BLOCK}] = "
                         f"{w_scale_shape}, got {w_scale.dtype} {tuple(w_scale.shape)}")
    if out is None:
        out = torch.empty((num_tokens, num_groups, out_dim), dtype=torch.bfloat16,
                          device=x.device)
    elif out.shape != (num_tokens, num_groups, out_dim) or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, G, D] = {(num_tokens, num_groups, out_dim)} with "
                         f"contiguous rows, got {tuple(out.shape)}")
    if num_tokens == 0:
        return out
    fp8_dot = hardware_fp8_encode(x.device)
    tiling = tiling or default_tiling(num_tokens, fp8_dot)
    row_blocks = triton.cdiv(out_dim, tiling.block_d)
    token_blocks = triton.cdiv(num_tokens, tiling.block_t)
    tiles = row_blocks * token_blocks * num_groups
    strides = (x.stride(0), x.stride(1), x_scale.stride(0), x_scale.stride(1),
               x_scale.stride(2), w.stride(0), w.stride(1), w_scale.stride(0),
               w_scale.stride(1), w_scale.stride(2), out.stride(0), out.stride(1))
    constants = dict(
        BLOCK_T=tiling.block_t,
        BLOCK_D=tiling.block_d,
        SCALE_BLOCK=SCALE_BLOCK,
        DOT_DTYPE=dot_dtype(),
        FP8_DOT=fp8_dot,
        FAST_DEQUANT=not triton.knobs.runtime.interpret,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    if tiling.splits:
        splits = even_split_count(tiling.splits, num_blocks)
    elif x.device.type != "cuda":
        splits = cheapest_split_count(tiles, num_blocks, INTERPRETER_SMS, programs_per_sm=1)
    else:
        # The partial sums and arrival counts only as dtypes: this compiles, it does not run.
        probe = (x, x_scale, w, w_scale, out, torch.float32, torch.int32, num_tokens, out_dim,
                 num_blocks, 2, 2, *strides)
        splits = cheapest_split_count(
            tiles, num_blocks, context_sm_count(x.device.index),
            programs_per_sm(tiling, probe, dict(constants, SPLIT_K=True)))
    if splits > 1:
        partial = torch.empty(tiles * splits * tiling.block_t * tiling.block_d,
                              dtype=torch.float32, device=x.device)
        arrivals = arrival_counts(x.device, tiles)
    else:
        partial = arrivals = out  # not read without splits
    _fp8_einsum_kernel[(row_blocks, token_blocks * splits, num_groups)](
        x, x_scale, w, w_scale, out, partial, arrivals,
        num_tokens, out_dim, num_blocks, splits, triton.cdiv(num_blocks, splits), *strides,
        SPLIT_K=splits > 1, **constants,
    )
    return out


def dequantize_blocks(values: torch.Tensor, scale: torch.Tensor, dims: tuple[int, ...]
                      ) -> torch.Tensor:
    """fp32 values of fp8 `values` times `scale`, one scale a 128-wide block along each
    of `dims` (the last block may be partial)."""
    expanded = scale.float()
    for dim in dims:
        expanded = expanded.repeat_interleave(SCALE_BLOCK, dim=dim).narrow(
            dim, 0, values.shape[dim])
    return decode_e4m3_reference(as_bytes(values)) * expanded


def fp8_einsum_reference(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                         w_scale: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference in fp32: [T, G, D]."""
    x_values = dequantize_blocks(x, x_scale, dims=(2,))
    w_values = dequantize_blocks(w, w_scale, dims=(1, 2))
    return torch.einsum("tgr,gdr->tgd", x_values, w_values)
