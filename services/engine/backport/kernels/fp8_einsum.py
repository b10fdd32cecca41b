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
- each step turns both fp8 tiles into dot operands (exact bf16 decoded in software, no
  fp8 instruction; on sm89 and later the fp8 bytes as they are), one dot gives the
  block's fp32 sums, and the two scales multiply them before they join the accumulator,
  as DeepGEMM promotes its per-block sums;
- a decode step (few tokens) is a read of the weight, far too few tiles to fill the card:
  R is split over several programs a tile (split-K), and the last of them to finish adds
  the splits' fp32 sums; a prefill chunk takes square tiles, unsplit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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
    # Programs sharing one output tile's reduction (decode steps): 0 picks enough to put
    # about TARGET_PROGRAMS_PER_SM programs on each SM, 1 is no split.
    splits: int = 1


# On the H200 in sm80 mode (weights cold in the L2) 3 ran a one-token step at G=8 in
# 0.0191 ms against 0.0238 for 4; without splits a one-token step at G=2 took 2.8x as long.
TARGET_PROGRAMS_PER_SM = 3


def default_tiling(num_tokens: int) -> EinsumTiling:
    """The tiling for T tokens: decode steps read the weight, split along R over the
    card; prefill chunks compute, in square tiles."""
    # 64 weight rows a program: 32 or 128 (at 8 warps) were up to 20% slower at 1-8 tokens.
    if num_tokens <= 16:
        return EinsumTiling(block_t=16, block_d=64, num_warps=4, num_stages=3, splits=0)
    if num_tokens <= 64:
        return EinsumTiling(block_t=64, block_d=64, num_warps=4, num_stages=3, splits=0)
    # 2 stages: 3 need 131,072 B of shared memory, over sm86's limit, for 3% more speed;
    # 64-wide tiles ran 1.4x slower.
    return EinsumTiling(block_t=128, block_d=128, num_warps=8, num_stages=2)


@triton.jit
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
    SPLITS: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FP8_DOT: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
):
    # Row blocks vary fastest, so programs running together share their token tile.
    row_block = tl.program_id(0)
    token_block = tl.program_id(1) // SPLITS
    split = tl.program_id(1) % SPLITS
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

    blocks_per_split = tl.cdiv(num_blocks, SPLITS)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for block in range(split * blocks_per_split,
                       tl.minimum((split + 1) * blocks_per_split, num_blocks)):
        x_raw = tl.load(x_tile + block * SCALE_BLOCK, mask=token_mask[:, None], other=0)
        w_raw = tl.load(w_tile + block * SCALE_BLOCK, mask=row_mask[:, None], other=0)
        sums = tl.dot(dot_operand(x_raw, DOT_DTYPE, FP8_DOT, FAST_DEQUANT),
                      tl.trans(dot_operand(w_raw, DOT_DTYPE, FP8_DOT, FAST_DEQUANT)))
        x_scale = tl.load(x_scales + block * stride_xs_block, mask=token_mask, other=0.0)
        w_scale = tl.load(w_scales + block * stride_ws_block, mask=row_mask, other=0.0)
        acc += sums * x_scale[:, None] * w_scale[None, :]

    out = (out_ptr + tokens.to(tl.int64)[:, None] * stride_out_token + group * stride_out_group
           + rows[None, :])
    out_mask = token_mask[:, None] & row_mask[None, :]
    if SPLITS == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Each split leaves its fp32 sums in its own slot; the last of the tile's programs
        # to arrive adds the slots in split order (the same result every run), writes the
        # tile and resets the tile's arrival count for the next launch.
        tile = (group * tl.num_programs(1) // SPLITS + token_block) * tl.num_programs(0) + row_block
        slots = (partial_ptr + tile.to(tl.int64) * SPLITS * BLOCK_T * BLOCK_D
                 + tl.arange(0, BLOCK_T)[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :])
        # Padding tokens' rows stay unwritten and unread: a decode step of one token
        # moves one row a split, not BLOCK_T.
        tl.store(slots + split * BLOCK_T * BLOCK_D, acc, mask=token_mask[:, None])
        # acq_rel: this split's sums are visible before its arrival counts, and the last
        # arrival sees every other split's.
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for other in range(SPLITS):
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


def split_count(tiling: EinsumTiling, tiles: int, num_blocks: int, device: torch.device) -> int:
    """The splits of R a launch uses: the tiling's, or (0) enough for about
    TARGET_PROGRAMS_PER_SM programs an SM, at least 2 scale blocks a split."""
    if tiling.splits:
        return max(1, min(tiling.splits, num_blocks))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if (
        device.type == "cuda") else 4  # the interpreter: a few splits, to exercise them
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * sms, tiles)
    return max(1, min(wanted, num_blocks // 2))


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
    tiling = tiling or default_tiling(num_tokens)
    row_blocks = triton.cdiv(out_dim, tiling.block_d)
    token_blocks = triton.cdiv(num_tokens, tiling.block_t)
    tiles = row_blocks * token_blocks * num_groups
    splits = split_count(tiling, tiles, num_blocks, x.device)
    if splits > 1:
        partial = torch.empty(tiles * splits * tiling.block_t * tiling.block_d,
                              dtype=torch.float32, device=x.device)
        arrivals = arrival_counts(x.device, tiles)
    else:
        partial = arrivals = out  # not read without splits
    _fp8_einsum_kernel[(row_blocks, token_blocks * splits, num_groups)](
        x, x_scale, w, w_scale, out, partial, arrivals,
        num_tokens, out_dim, num_blocks,
        x.stride(0), x.stride(1),
        x_scale.stride(0), x_scale.stride(1), x_scale.stride(2),
        w.stride(0), w.stride(1),
        w_scale.stride(0), w_scale.stride(1), w_scale.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_T=tiling.block_t,
        BLOCK_D=tiling.block_d,
        SPLITS=splits,
        SCALE_BLOCK=SCALE_BLOCK,
        DOT_DTYPE=dot_dtype(),
        FP8_DOT=hardware_fp8_encode(x.device),
        FAST_DEQUANT=not triton.knobs.runtime.interpret,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
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
