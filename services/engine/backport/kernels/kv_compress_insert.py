"""Attention KV compress + RMSNorm + RoPE + fp8 quant + insert into the fp8_ds_mla cache.

DeepSeek-V4's main (head 512) compressor. Upstream runs it as a CuTe-DSL kernel on CUDA
(sm89 PTX) and as the Triton `_fused_kv_compress_norm_rope_insert_sparse_attn`
(deepseek_v4/common/ops/fused_compress_quant_cache.py) elsewhere, which casts with
`tl.float8e4nv`; neither runs on sm80/86. Same inputs and semantics as the Triton one:

- state_cache [num_state_blocks, state_block_size, 2 * state_width] fp32 as
  `compressor_window` describes (state_width = 512, or 1024 with overlap at ratio 4);
- a token at position p with (p + 1) % ratio == 0 closes a window: its (1 + overlap) *
  ratio state rows are merged with softmax weights, RMS-normalized (fp32), and written to
  kv_slot_mapping[t] of a `ds_mla_cache` cache: the 448 NoPE values rounded to bf16 and
  quantized per 64-dim tile (UE8M0 scale from amax floored at 1e-4), the 64 RoPE values
  rotated (GPT-J pairs, at position (p // ratio) * ratio) and stored as bf16.
Tokens whose state slot or cache slot is -1, or that close no window, write nothing.

Tiling: a program finishes a token's row with 512 dims across 4 warps, one token a
program, except at ratio 128 in batches past decode size: there TOKENS_PER_PROGRAM (most
tokens close no window and cost only four scalar loads). It merges the window itself (the
ratio-4 window, 8 rows, in one piece; the ratio-128 one, 128 x 512 values, ROW_CHUNK rows
at a time with an online softmax), except at ratio 128 in decode-sized batches, where
`_merge_slices_kernel` has merged it first over dim slices, many programs a window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.compressor_window import (
    checked_state_width,
    closing_token,
    gptj_rotate,
    gptj_rotate_reference,
    merge_window,
    merge_window_reference,
    rms_normalize,
    rms_normalize_reference,
    window_kernel_args,
)
from services.engine.backport.kernels.fp8_e4m3 import hardware_fp8_encode, round_to_bf16
from services.engine.backport.kernels.k_cache_insert import TILES_PER_ROW, store_ds_mla_rows

# Rows of the window in registers at once when one program merges all 512 dims: [8, 512]
# fp32 kv and scores over 128 threads (H200 sm80 mode, T=32768 ratio 128, graph ms: 4 rows
# 0.0781, 8 0.0781, 16 0.0951, 32 0.1264).
ROW_CHUNK = 8
# Batches of up to this many tokens (decode steps, small prefill chunks) close few windows,
# and one program a token costs little. At ratio 128 one program a window streams its
# 512 KB alone, so there the window is first merged by HEAD_DIM // MERGE_SLICE programs of
# MERGE_SLICE dims each (H200 sm80 mode, 64 decode tokens: one window 26.5 -> 7.6 us, 64
# windows 31.1 -> 11.3 us; T=2048, 16 windows: 31.3 -> 26.8 us; at T=4096 slower).
DECODE_PLAN_MAX_TOKENS = 2048
MERGE_SLICE = 32
SLICE_ROW_CHUNK = 64  # [64 rows, 32 dims] fp32 kv and scores over 64 threads
# Larger batches are prefill chunks. At ratio 128 at most one token in 128 closes a
# window, and the rest would each cost a program that loads four scalars and stops, so a
# program walks TOKENS_PER_PROGRAM tokens (T=32768: 78.3 -> 62.2 us; 16 or more tokens no
# better). At ratio 4 a quarter of the tokens close one, and walking them in one program
# only serializes windows (T=32768: 82.7 -> 87.5 us at 8 tokens), so there it stays one.
TOKENS_PER_PROGRAM = 8
HEAD_DIM = tl.constexpr(layout.HEAD_DIM)
NOPE_DIM = tl.constexpr(layout.NOPE_DIM)
HALF_ROPE = tl.constexpr(layout.ROPE_DIM // 2)
QUANT_TILE = tl.constexpr(layout.QUANT_TILE)
NUM_NOPE_TILES = tl.constexpr(layout.NUM_NOPE_TILES)
DATA_BYTES = tl.constexpr(layout.DATA_BYTES_PER_TOKEN)
SCALE_BYTES = tl.constexpr(layout.SCALE_BYTES_PER_TOKEN)
ROW_TILES = tl.constexpr(TILES_PER_ROW)


@triton.jit
def _kv_compress_kernel(
    state_ptr,
    token_to_req_ptr,
    positions_ptr,
    state_slots_ptr,
    block_table_ptr,
    norm_weight_ptr,
    cos_sin_ptr,
    cache_ptr,
    cache_slots_ptr,
    norm_eps,
    state_block_size,
    stride_state_block,
    stride_state_row,
    stride_table_req,
    stride_cos_sin,
    merged_ptr,
    num_tokens,
    cache_block_stride,
    CACHE_BLOCK_SIZE: tl.constexpr,
    STATE_WIDTH: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    HARDWARE_FP8: tl.constexpr,
):
    first_token = tl.program_id(0).to(tl.int64) * TOKENS_PER_PROGRAM
    for step in range(TOKENS_PER_PROGRAM):  # a constant trip count: one token folds away
        token = tl.minimum(first_token + step, num_tokens - 1)
        position, cache_slot, closes = closing_token(positions_ptr, state_slots_ptr,
                                                     cache_slots_ptr, token, RATIO)
        if closes & (first_token + step < num_tokens):
            if merged_ptr is None:
                request = tl.load(token_to_req_ptr + token).to(tl.int64)
                merged = merge_window(state_ptr, block_table_ptr + request * stride_table_req,
                                      position, 0, state_block_size, stride_state_block,
                                      stride_state_row, HEAD_DIM, HEAD_DIM, STATE_WIDTH, RATIO,
                                      OVERLAP, ROW_CHUNK)
            else:  # merged by _merge_slices_kernel
                merged = tl.load(merged_ptr + token * HEAD_DIM + tl.arange(0, HEAD_DIM))
            normed = rms_normalize(merged, norm_weight_ptr, norm_eps, HEAD_DIM)
            cos_sin_row = cos_sin_ptr + (position // RATIO) * RATIO * stride_cos_sin
            # The NoPE dims come back from the rotation unchanged: bf16 of the normalized
            # values (upstream's quant input), and bf16 of the rotated RoPE values (its
            # stored ones).
            row = round_to_bf16(gptj_rotate(normed, cos_sin_row, HEAD_DIM, HALF_ROPE))

            slot = tl.zeros((1,), tl.int64) + cache_slot  # store_ds_mla_rows takes rows [R]
            page = (slot // CACHE_BLOCK_SIZE) * cache_block_stride
            in_page = slot % CACHE_BLOCK_SIZE
            store_ds_mla_rows(
                cache_ptr,
                page + in_page * DATA_BYTES,
                page + CACHE_BLOCK_SIZE * DATA_BYTES + in_page * SCALE_BYTES,
                tl.reshape(row, (1, ROW_TILES, QUANT_TILE)),
                slot >= 0,
                NOPE_DIM,
                QUANT_TILE,
                NUM_NOPE_TILES,
                ROW_TILES,
                HARDWARE_FP8,
            )


@triton.jit
def _merge_slices_kernel(
    state_ptr,
    token_to_req_ptr,
    positions_ptr,
    state_slots_ptr,
    block_table_ptr,
    cache_slots_ptr,
    merged_ptr,
    state_block_size,
    stride_state_block,
    stride_state_row,
    stride_table_req,
    STATE_WIDTH: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    SLICE: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
):
    """Program (token, s) merges dims s * SLICE.. of the token's window into merged[token]."""
    token = tl.program_id(0).to(tl.int64)
    position, _, closes = closing_token(positions_ptr, state_slots_ptr, cache_slots_ptr, token,
                                        RATIO)
    if not closes:
        return
    request = tl.load(token_to_req_ptr + token).to(tl.int64)
    first_dim = tl.program_id(1) * SLICE
    merged = merge_window(state_ptr, block_table_ptr + request * stride_table_req, position,
                          first_dim, state_block_size, stride_state_block, stride_state_row,
                          SLICE, HEAD_DIM, STATE_WIDTH, RATIO, OVERLAP, ROW_CHUNK)
    tl.store(merged_ptr + token * HEAD_DIM + first_dim + tl.arange(0, SLICE), merged)


def kv_compress_insert(
    state_cache: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    compress_ratio: int,
    block_size: int | None = None,
) -> None:
    """Compress, normalize, rotate, quantize and insert attention KV rows (module doc).
    kv_cache: [num_blocks, page_bytes] (give block_size) or FlashMLA's strided view."""
    state_width = checked_state_width(state_cache, compress_ratio, layout.HEAD_DIM)
    geometry = layout.cache_geometry(kv_cache, block_size)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    overlap = int(compress_ratio == 4)
    decode_plan = num_tokens <= DECODE_PLAN_MAX_TOKENS
    merged = None
    if compress_ratio == 128 and decode_plan:
        merged = torch.empty(num_tokens, layout.HEAD_DIM, device=state_cache.device)
        _merge_slices_kernel[(num_tokens, layout.HEAD_DIM // MERGE_SLICE)](
            state_cache,
            token_to_req_indices,
            positions,
            slot_mapping,
            block_table,
            kv_slot_mapping,
            merged,
            state_cache.shape[1],
            state_cache.stride(0),
            state_cache.stride(1),
            block_table.stride(0),
            STATE_WIDTH=state_width,
            RATIO=compress_ratio,
            OVERLAP=overlap,
            SLICE=MERGE_SLICE,
            ROW_CHUNK=SLICE_ROW_CHUNK,
            num_warps=2,
        )
    tokens_per_program = 1 if decode_plan or compress_ratio == 4 else TOKENS_PER_PROGRAM
    _kv_compress_kernel[(triton.cdiv(num_tokens, tokens_per_program),)](
        *window_kernel_args(state_cache, token_to_req_indices, positions, slot_mapping,
                            block_table, rms_norm_weight, cos_sin_cache, kv_cache,
                            kv_slot_mapping, rms_norm_eps),
        merged,
        num_tokens,
        geometry.block_stride,
        CACHE_BLOCK_SIZE=geometry.block_size,
        STATE_WIDTH=state_width,
        RATIO=compress_ratio,
        OVERLAP=overlap,
        ROW_CHUNK=ROW_CHUNK,
        TOKENS_PER_PROGRAM=tokens_per_program,
        HARDWARE_FP8=hardware_fp8_encode(kv_cache.device),
        num_warps=4,
    )


def kv_compress_insert_reference(
    state_cache: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    compress_ratio: int,
    block_size: int | None = None,
) -> None:
    """torch reference of `kv_compress_insert` (one token at a time)."""
    checked_state_width(state_cache, compress_ratio, layout.HEAD_DIM)
    for token in range(positions.shape[0]):
        position = int(positions[token])
        slot = int(kv_slot_mapping[token])
        if int(slot_mapping[token]) < 0 or (position + 1) % compress_ratio or slot < 0:
            continue
        block_table_row = block_table[int(token_to_req_indices[token])]
        merged = merge_window_reference(
            state_cache, block_table_row, position, compress_ratio, layout.HEAD_DIM
        )
        normed = rms_normalize_reference(merged, rms_norm_weight, rms_norm_eps)
        rope_position = (position // compress_ratio) * compress_ratio
        rotated = gptj_rotate_reference(normed, cos_sin_cache[rope_position], layout.ROPE_DIM)
        layout.insert_rows_reference(
            rotated.to(torch.bfloat16)[None], kv_cache, torch.tensor([slot]), block_size
        )
