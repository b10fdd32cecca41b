"""Sparse MLA decode over the fp8_ds_mla paged cache, split-K, for sm80/86/89.

Replaces FlashMLA's sparse fp8 decode (`flash_mla_with_kvcache(..., is_fp8_kvcache=True,
indices=...)`) as DeepSeek-V4 calls it (`deepseek_v4/nvidia/flashmla.py`): every query
token has its own list of global cache slots (-1 = padding) and a valid length; an
optional second ("extra") cache with its own slot lists and lengths joins the same
softmax. In DeepSeek-V4 the first cache is the sliding window (SWA) and the extra one
the compressed cache picked by the indexer (top-k up to 2048). K = V (MQA, one KV head):
a dequantized 512-dim row is both key and value, so out has 512 dims per head.

Semantics, the reference being `sparse_mla_decode_reference`:
- valid keys of token t: slots[t, i] >= 0 with i < length[t] (length absent = all);
- scores = softmax_scale * q . k over valid keys of both caches;
- attention sink: out *= 2**lse / (2**lse + e**sink[h]) (see `sparse_mla_combine`);
- returns out [T, H, 512] (q's dtype) and lse [T, H] (natural log, without the sink);
  a token with no valid key gets out = 0, lse = +inf (FlashMLA's convention).

Tiling:
- a program owns HEADS_PER_PROGRAM heads of one token, so one pass over a K row
  serves all those heads (the row is read once per head block, not once per head);
- keys go BLOCK_N at a time: fp8 bytes go straight to one [BLOCK_N, 512] bf16 tile
  (`e4m3_dequantize_bf16`, fp32 under the interpreter) that feeds both dots (q . k^T
  for scores, p . k for the output), exact because UE8M0 scales are powers of two;
- the loop prefetches by hand: row bytes one block ahead, slots two blocks ahead;
- split-K: the two slot lists are each cut into `num_splits` equal pieces, one per
  program along grid axis 1, so a long list at batch 1 still fills the GPU; the
  default is the cheapest count under a cost model (`decode_splits`); when num_splits > 1
  the programs write normalized partials and `combine_splits` merges them; with one
  split the program finalizes and writes the output itself.
Measured (docs/kernels.md, and how in docs/kernels-history.md): correct in sm80/86/89
mode, but far from bandwidth-bound: 255 registers a thread limit it to 2 programs per
SM; see the notes there.
Grid = (head blocks, splits, tokens): head blocks of one (split, token) run side by
side, so the K rows they share come from L2.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.cuda_module import context_sm_count, cuda_device_index
from services.engine.backport.kernels.decode_splits import SplitCostModel
from services.engine.backport.kernels.fp8_e4m3 import e4m3_dequantize_bf16
from services.engine.backport.kernels.online_softmax import (
    attend_block,
    initial_state,
    natural_lse,
    normalized,
)
from services.engine.backport.kernels.sparse_mla_combine import LOG2E, apply_sink, combine_splits

# Row geometry (ds_mla_cache) as compile-time constants for the kernels.
HEAD_DIM = tl.constexpr(layout.HEAD_DIM)  # 512
NOPE_DIM = tl.constexpr(layout.NOPE_DIM)  # 448 fp8 values, then the RoPE values
QUANT_TILE = tl.constexpr(layout.QUANT_TILE)  # 64 values share one UE8M0 scale
TILES_PER_ROW = tl.constexpr(8)  # a row as 8 tiles of 64: 7 fp8 tiles + the bf16 RoPE tile
DATA_BYTES = tl.constexpr(layout.DATA_BYTES_PER_TOKEN)  # 576
SCALE_BYTES = tl.constexpr(layout.SCALE_BYTES_PER_TOKEN)  # 8
# Keys per step: [32, 512] bf16 = 32 KiB of K. In sm80 mode on the H200 (B=64, H=64,
# top-k 2048) 32 ran 0.29 ms with 10 spilled registers, 16 ran 0.39 ms with none.
DEFAULT_BLOCK_N = 32
# 16 heads a program (tl.dot needs M >= 16): 49 KiB of shared memory, fits sm86/89's
# 99 KiB (H200, Triton 3.6); 32 heads at 8 warps spilled over 100 registers in sm80 mode.
DEFAULT_HEADS_PER_PROGRAM = 16
# 255 registers x 128 threads: two programs fit in an SM's 64K registers.
PROGRAMS_PER_SM = 2
SM_COUNT_WITHOUT_CUDA = 108  # an A100's, for the split choice under the interpreter
MAX_SPLITS = 64  # the combine step loads all splits of a slice at once
# The split rule's model, in steps of DEFAULT_BLOCK_N keys; each list is cut into steps of
# its own. Fitted like the CUDA decode's (`bench/kernels.py --sms N --sweep-splits`; 1..32
# and 40..64 splits for grids of up to 16 programs, 1..12 above; 12 shapes on 132, 112 and
# 88 SMs, H200 in sm80 mode; tests/kernels/data): the pick is at most 3.0% slower than the
# fastest measured count. The rule it replaced, which filled one wave, was up to 47% slower
# (112 SMs, B=128 H=16 top-k 2048: 0.281 ms at 1 split against 0.190 at 5).
SPLIT_COST = SplitCostModel(
    keys_per_step=DEFAULT_BLOCK_N,
    lists_share_steps=False,
    fixed_steps_per_block=1.5,
    shared_sm_speedup=1.2,
    combine_steps_per_split=0.01,
    max_splits=MAX_SPLITS,
)


@triton.jit
def load_slots(slot_row_ptr, positions, list_width, list_length, stop):
    """Slots at list `positions` and whether each is a valid key (in range, not -1)."""
    in_list = (positions < list_width) & (positions < list_length) & (positions < stop)
    slots = tl.load(slot_row_ptr + positions, mask=in_list, other=-1)
    return slots, in_list & (slots >= 0)


@triton.jit
def load_row_bytes(cache_ptr, slots, valid, block_stride, BLOCK_SIZE: tl.constexpr):
    """Raw bytes of the rows at `slots`: fp8 [N, 8, 64] (tile 7 is RoPE bytes, unused),
    UE8M0 scales [N, 8] and RoPE values [N, 64] bf16."""
    slot = tl.where(valid, slots, 0).to(tl.int64)
    page = (slot // BLOCK_SIZE) * block_stride
    position = slot % BLOCK_SIZE
    data = page + position * DATA_BYTES
    scale_at = page + BLOCK_SIZE * DATA_BYTES + position * SCALE_BYTES
    tile = tl.arange(0, TILES_PER_ROW)
    dim = tl.arange(0, QUANT_TILE)
    # 512 contiguous bytes per row; no mask along the row keeps the loads 16 B wide.
    raw = tl.load(
        cache_ptr + data[:, None, None] + (tile[None, :, None] * QUANT_TILE + dim[None, None, :]),
        mask=valid[:, None, None],
        other=0,
    )
    scale_byte = tl.load(
        cache_ptr + scale_at[:, None] + tile[None, :], mask=valid[:, None], other=0
    )
    rope_ptr = (cache_ptr + data + NOPE_DIM).to(tl.pointer_type(tl.bfloat16))
    rope = tl.load(rope_ptr[:, None] + dim[None, :], mask=valid[:, None], other=0.0)
    return raw, scale_byte, rope


@triton.jit
def decode_rows(
    raw,
    scale_byte,
    rope,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
):
    """Row bytes -> [BLOCK_N, 512] K tile: 7 dequantized fp8 tiles, then the RoPE tile.

    Straight to bf16 (`e4m3_dequantize_bf16`, 2 instructions a value on a GPU); tile 7's
    decode of the RoPE bytes is discarded by the select.
    """
    tile = tl.arange(0, TILES_PER_ROW)
    nope = e4m3_dequantize_bf16(raw, scale_byte.to(tl.int32)[:, :, None] - 127, FAST_DEQUANT)
    k = tl.where(tile[None, :, None] == TILES_PER_ROW - 1, rope[:, None, :], nope)
    return tl.reshape(k, (BLOCK_N, HEAD_DIM)).to(DOT_DTYPE)


@triton.jit
def load_k_block(
    cache_ptr,
    slots,
    valid,
    block_stride,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
):
    """Dequantize BLOCK_N cache rows at `slots` into a [BLOCK_N, 512] tile of DOT_DTYPE."""
    raw, scale_byte, rope = load_row_bytes(cache_ptr, slots, valid, block_stride, BLOCK_SIZE)
    return decode_rows(raw, scale_byte, rope, BLOCK_N, DOT_DTYPE, FAST_DEQUANT)


@triton.jit
def attend_slot_range(
    q,
    m_i,
    l_i,
    acc,
    cache_ptr,
    slot_row_ptr,
    list_width,
    list_length,
    start,
    stop,
    block_stride,
    qk_scale_log2,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
):
    """Online softmax (base 2) over list positions [start, stop) of one slot list.

    Software-pipelined by hand: while block i is decoded and multiplied, the row bytes
    of block i + 1 and the slots of block i + 2 are already in flight, so the two
    dependent loads (slot, then row) overlap the math instead of stalling it.
    """
    offsets = tl.arange(0, BLOCK_N)
    slots, valid = load_slots(slot_row_ptr, start + offsets, list_width, list_length, stop)
    raw, scale_byte, rope = load_row_bytes(cache_ptr, slots, valid, block_stride, BLOCK_SIZE)
    next_slots, next_valid = load_slots(
        slot_row_ptr, start + BLOCK_N + offsets, list_width, list_length, stop
    )
    for block_start in range(start, stop, BLOCK_N):
        after_slots, after_valid = load_slots(
            slot_row_ptr, block_start + 2 * BLOCK_N + offsets, list_width, list_length, stop
        )
        next_raw, next_scale_byte, next_rope = load_row_bytes(
            cache_ptr, next_slots, next_valid, block_stride, BLOCK_SIZE
        )
        k = decode_rows(raw, scale_byte, rope, BLOCK_N, DOT_DTYPE, FAST_DEQUANT)
        m_i, l_i, acc = attend_block(q, k, valid, m_i, l_i, acc, qk_scale_log2, DOT_DTYPE)

        raw, scale_byte, rope, valid = next_raw, next_scale_byte, next_rope, next_valid
        next_slots, next_valid = after_slots, after_valid
    return m_i, l_i, acc


@triton.jit
def _sparse_mla_decode_kernel(
    q_ptr,
    cache_ptr,
    slots_ptr,
    lengths_ptr,
    extra_cache_ptr,
    extra_slots_ptr,
    extra_lengths_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    num_heads,
    list_width,
    extra_list_width,
    split_len,
    extra_split_len,
    block_stride,
    extra_block_stride,
    qk_scale_log2,
    stride_q_token,
    stride_q_head,
    stride_slots_token,
    stride_extra_slots_token,
    stride_out_token,
    stride_out_head,
    stride_po_token,
    stride_po_split,
    stride_po_head,
    stride_pl_token,
    stride_pl_split,
    BLOCK_SIZE: tl.constexpr,
    EXTRA_BLOCK_SIZE: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_EXTRA_LENGTHS: tl.constexpr,
    HAS_SINK: tl.constexpr,
    IS_SINGLE_SPLIT: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
):
    # Program ids.
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    token = tl.program_id(2).to(tl.int64)
    heads = head_block * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    head_mask = heads < num_heads
    dims = tl.arange(0, HEAD_DIM)

    # The query block stays in registers for the whole loop.
    q_ptrs = q_ptr + token * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None], other=0.0).to(DOT_DTYPE)

    m_i, l_i, acc = initial_state(HEADS_PER_PROGRAM, HEAD_DIM)

    # Loop over this split's piece of the first slot list, then of the extra list.
    length = list_width
    if HAS_LENGTHS:
        length = tl.load(lengths_ptr + token)
    start = split * split_len
    m_i, l_i, acc = attend_slot_range(
        q,
        m_i,
        l_i,
        acc,
        cache_ptr,
        slots_ptr + token * stride_slots_token,
        list_width,
        length,
        start,
        start + split_len,
        block_stride,
        qk_scale_log2,
        BLOCK_SIZE,
        BLOCK_N,
        DOT_DTYPE,
        FAST_DEQUANT,
    )
    if HAS_EXTRA:
        extra_length = extra_list_width
        if HAS_EXTRA_LENGTHS:
            extra_length = tl.load(extra_lengths_ptr + token)
        extra_start = split * extra_split_len
        m_i, l_i, acc = attend_slot_range(
            q,
            m_i,
            l_i,
            acc,
            extra_cache_ptr,
            extra_slots_ptr + token * stride_extra_slots_token,
            extra_list_width,
            extra_length,
            extra_start,
            extra_start + extra_split_len,
            extra_block_stride,
            qk_scale_log2,
            EXTRA_BLOCK_SIZE,
            BLOCK_N,
            DOT_DTYPE,
            FAST_DEQUANT,
        )

    # Write-back: normalized output and base-2 lse (-inf when nothing was valid).
    out, lse2, has_keys = normalized(acc, m_i, l_i)
    if IS_SINGLE_SPLIT:
        if HAS_SINK:
            out = apply_sink(out, lse2, sink_ptr, heads, head_mask)
        out_ptrs = (
            out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
        )
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
        tl.store(lse_ptr + token * num_heads + heads, natural_lse(lse2, has_keys),
                 mask=head_mask)
    else:
        po_ptrs = (
            partial_out_ptr
            + token * stride_po_token
            + split * stride_po_split
            + heads[:, None] * stride_po_head
            + dims[None, :]
        )
        tl.store(po_ptrs, out, mask=head_mask[:, None])
        tl.store(
            partial_lse_ptr + token * stride_pl_token + split * stride_pl_split + heads,
            lse2,
            mask=head_mask,
        )


def dot_dtype() -> tl.dtype:
    """bf16 operands for the tensor cores; fp32 under the interpreter, whose tl.dot
    multiplies bf16 operands' raw bits (seen with Triton 3.9's interpreter)."""
    return tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16


def as_token_major(x: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """Accept FlashMLA's [T, 1, ...] (one query per sequence) as well as [T, ...]."""
    if x is None:
        return None
    if (
        x.dim() >= 2
        and x.shape[1] == 1
        and name in ("q", "indices")
        and x.dim() == (4 if name == "q" else 3)
    ):
        x = x.squeeze(1)
    return x


@functools.cache
def device_sm_count(device: torch.device) -> int:
    """SMs the decode's programs spread over: the current context's (a green context's
    share), the first time it is asked on a device."""
    if device.type != "cuda":
        return SM_COUNT_WITHOUT_CUDA
    index = cuda_device_index(device)
    with torch.cuda.device(index):
        return context_sm_count(index)


def int32_rows(x: torch.Tensor | None) -> torch.Tensor | None:
    """Slots or lengths (int32 or int64) as int32 with contiguous rows. Slots fit in int32
    (2**31 rows of 584 B is 1.25 TB of cache), and Triton 3.6 fails to compile the decode
    for int64 slot lists."""
    if x is None:
        return None
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot lists and lengths must be int32 or int64, got {x.dtype}")
    if x.dtype != torch.int32 or x.stride(-1) != 1:
        x = x.to(torch.int32).contiguous()
    return x


@dataclass(frozen=True)
class DecodeOperands:
    """A decode call's q and slot lists in [T, ...] form, checked (slots as int32 with
    contiguous rows), and where the caches' pages are. Without an extra cache,
    extra_indices is None and extra_geometry repeats geometry."""

    q: torch.Tensor
    indices: torch.Tensor
    extra_indices: torch.Tensor | None
    geometry: layout.CacheGeometry
    extra_geometry: layout.CacheGeometry


def decode_operands(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    extra_k_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    block_size: int | None,
    extra_block_size: int | None,
) -> DecodeOperands:
    """Checks the shapes FlashMLA's sparse decode takes (see `sparse_mla_decode`)."""
    q = as_token_major(q, "q")
    indices = int32_rows(as_token_major(indices, "indices"))
    if q.dim() != 3 or q.shape[-1] != layout.HEAD_DIM or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, H, 512] with contiguous rows, got {tuple(q.shape)}")
    num_tokens = q.shape[0]
    if indices.dim() != 2 or indices.shape[0] != num_tokens:
        raise ValueError(f"indices must be [T, K], got {tuple(indices.shape)}")
    geometry = layout.cache_geometry(k_cache, block_size)
    if extra_k_cache is None:
        return DecodeOperands(q, indices, None, geometry, geometry)
    extra_indices = int32_rows(as_token_major(extra_indices, "indices"))
    if extra_indices is None or extra_indices.shape[0] != num_tokens:
        raise ValueError("extra_k_cache needs extra_indices [T, K2]")
    extra_geometry = layout.cache_geometry(extra_k_cache, extra_block_size)
    return DecodeOperands(q, indices, extra_indices, geometry, extra_geometry)


def choose_num_splits(programs: int, list_width: int, extra_list_width: int, sm_count: int,
                      block_n: int = DEFAULT_BLOCK_N) -> int:
    """Splits of each token's two slot lists for `programs` (token, head block) pairs on
    `sm_count` SMs: the cheapest under `SPLIT_COST` with steps of `block_n` keys."""
    model = SPLIT_COST if block_n == SPLIT_COST.keys_per_step else dataclasses.replace(
        SPLIT_COST, keys_per_step=block_n)
    return model.cheapest_splits(programs, list_width, extra_list_width, sm_count,
                                 PROGRAMS_PER_SM)


def sparse_mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    block_size: int | None = None,
    extra_block_size: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    heads_per_program: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode; returns (out [T, H, 512], lse [T, H] natural log).

    q [T, H, 512] (or [T, 1, H, 512]); caches uint8 (`ds_mla_cache`); indices [T, K]
    (or [T, 1, K]) int32/int64 global slots; lengths [T] int32/int64. Extra cache optional.
    """
    operands = decode_operands(
        q, k_cache, indices, extra_k_cache, extra_indices, block_size, extra_block_size
    )
    q, indices, extra_indices = operands.q, operands.indices, operands.extra_indices
    geometry, extra_geometry = operands.geometry, operands.extra_geometry
    has_extra = extra_indices is not None
    topk_length, extra_topk_length = int32_rows(topk_length), int32_rows(extra_topk_length)
    num_tokens, num_heads, _ = q.shape

    if heads_per_program is None:
        heads_per_program = DEFAULT_HEADS_PER_PROGRAM
    if num_warps is None:
        num_warps = 4
    num_head_blocks = triton.cdiv(num_heads, heads_per_program)
    list_width = indices.shape[1]
    extra_list_width = extra_indices.shape[1] if has_extra else 0
    if num_splits is None:
        num_splits = choose_num_splits(num_tokens * num_head_blocks, list_width,
                                       extra_list_width, device_sm_count(q.device), block_n)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    split_len = triton.cdiv(triton.cdiv(list_width, num_splits), block_n) * block_n
    extra_split_len = triton.cdiv(triton.cdiv(extra_list_width, num_splits), block_n) * block_n

    if out is None:
        out = torch.empty_like(q)
    out = as_token_major(out, "q")
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    is_single_split = num_splits == 1
    if is_single_split:
        partial_out = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        partial_lse = lse.new_empty((1, 1, 1))
    else:
        partial_out = torch.empty(
            (num_tokens, num_splits, num_heads, layout.HEAD_DIM),
            dtype=torch.float32,
            device=q.device,
        )
        partial_lse = torch.empty(
            (num_tokens, num_splits, num_heads), dtype=torch.float32, device=q.device
        )

    grid = (num_head_blocks, num_splits, num_tokens)
    placeholder = indices  # any tensor: pointers of absent inputs are never read
    _sparse_mla_decode_kernel[grid](
        q,
        k_cache,
        indices,
        topk_length if topk_length is not None else placeholder,
        extra_k_cache if has_extra else k_cache,
        extra_indices if has_extra else placeholder,
        extra_topk_length if extra_topk_length is not None else placeholder,
        attn_sink if attn_sink is not None else placeholder,
        out,
        lse,
        partial_out,
        partial_lse,
        num_heads,
        list_width,
        extra_list_width,
        split_len,
        extra_split_len,
        geometry.block_stride,
        extra_geometry.block_stride,
        softmax_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        indices.stride(0),
        extra_indices.stride(0) if has_extra else 0,
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        BLOCK_SIZE=geometry.block_size,
        EXTRA_BLOCK_SIZE=extra_geometry.block_size,
        HAS_LENGTHS=topk_length is not None,
        HAS_EXTRA=has_extra,
        HAS_EXTRA_LENGTHS=has_extra and extra_topk_length is not None,
        HAS_SINK=attn_sink is not None,
        IS_SINGLE_SPLIT=is_single_split,
        HEADS_PER_PROGRAM=heads_per_program,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype(),
        FAST_DEQUANT=not triton.knobs.runtime.interpret,
        num_warps=num_warps,
        num_stages=1,
    )
    if not is_single_split:
        combine_splits(partial_out, partial_lse, attn_sink, out, lse)
    return out, lse


def sparse_mla_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    block_size: int | None = None,
    extra_block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference in fp32 (q rounded to bf16 as the kernel reads it)."""
    q = as_token_major(q, "q").float()
    lists = [(k_cache, as_token_major(indices, "indices"), topk_length, block_size)]
    if extra_k_cache is not None:
        lists.append(
            (
                extra_k_cache,
                as_token_major(extra_indices, "indices"),
                extra_topk_length,
                extra_block_size,
            )
        )
    all_rows, all_valid = [], []
    for cache, slots, lengths, size in lists:
        slots = slots.to(torch.int64)
        positions = torch.arange(slots.shape[1], device=slots.device)
        valid = slots >= 0
        if lengths is not None:
            valid &= positions.unsqueeze(0) < lengths.to(torch.int64).unsqueeze(1)
        all_rows.append(layout.read_rows_reference(cache, torch.where(valid, slots, -1), size))
        all_valid.append(valid)
    rows = torch.cat(all_rows, dim=1)  # [T, K, 512]
    valid = torch.cat(all_valid, dim=1)  # [T, K]
    scores = torch.einsum("thd,tkd->thk", q, rows) * softmax_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("thk,tkd->thd", probs, rows)
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink.float()).nan_to_num(0.0).unsqueeze(-1)
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))
