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

Tiling: a program scans SCAN consecutive tokens with one vector load and finishes each
closing one in turn, a row of 512 dims across 4 warps. SCAN is 1 at ratio 4 (a quarter
of the tokens close a window) and at ratio 128 as many tokens as the batch has a request,
a power of two up to MAX_SCAN (`tokens_a_program`): a long prefill chunk closes one window
in 128 tokens, and one program a token would mostly load four scalars and stop, while in
a decode step every token may close one. The ratio-4 window (8 rows) is merged in one
piece by the program that finishes it; the ratio-128 one (128 x 512 values) is merged
first by `kv_window_merge`, into an fp32 scratch row, with the same SCAN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.compressor_window import (
    checked_state_width,
    closing_token,
    closing_tokens,
    gptj_rotate,
    gptj_rotate_reference,
    merge_window,
    merge_window_reference,
    next_closing,
    rms_normalize,
    rms_normalize_reference,
    tokens_per_request,
    window_kernel_args,
)
from services.engine.backport.kernels.fp8_e4m3 import fp8_encoder, round_to_bf16
from services.engine.backport.kernels.k_cache_insert import TILES_PER_ROW, store_ds_mla_rows
from services.engine.backport.kernels.kv_window_merge import MAX_GRID_Y, merge_windows

# The ratio-4 window, 8 rows, merged in one piece by the program that finishes its row:
# [8, 512] fp32 kv and scores over 128 threads.
ROW_CHUNK = 8
# Longer scans serialize windows (whole H200, 64-row merge steps: T=32768 128 tokens 50.2
# us, 256 48.8; T=8192 13.2, 19.0).
MAX_SCAN = 128
HEAD_DIM = tl.constexpr(layout.HEAD_DIM)
NOPE_DIM = tl.constexpr(layout.NOPE_DIM)
HALF_ROPE = tl.constexpr(layout.ROPE_DIM // 2)
QUANT_TILE = tl.constexpr(layout.QUANT_TILE)
NUM_NOPE_TILES = tl.constexpr(layout.NUM_NOPE_TILES)
DATA_BYTES = tl.constexpr(layout.DATA_BYTES_PER_TOKEN)
SCALE_BYTES = tl.constexpr(layout.SCALE_BYTES_PER_TOKEN)
ROW_TILES = tl.constexpr(TILES_PER_ROW)


@triton.jit
def compress_row(
    token,
    position,
    cache_slot,
    state_ptr,
    token_to_req_ptr,
    block_table_ptr,
    norm_weight_ptr,
    cos_sin_ptr,
    cache_ptr,
    merged_ptr,
    norm_eps,
    state_block_size,
    stride_state_block,
    stride_state_row,
    stride_table_req,
    stride_cos_sin,
    cache_block_stride,
    CACHE_BLOCK_SIZE: tl.constexpr,
    STATE_WIDTH: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    FP8_ENCODER: tl.constexpr,
):
    """Merge (or read the merged row), normalize, rotate, quantize and insert one token's row."""
    if merged_ptr is None:
        request = tl.load(token_to_req_ptr + token).to(tl.int64)
        merged = merge_window(state_ptr, block_table_ptr + request * stride_table_req, position,
                              0, state_block_size, stride_state_block, stride_state_row,
                              HEAD_DIM, HEAD_DIM, STATE_WIDTH, RATIO, OVERLAP, ROW_CHUNK)
    else:  # merged by _merge_slices_kernel
        merged = tl.load(merged_ptr + token * HEAD_DIM + tl.arange(0, HEAD_DIM))
    normed = rms_normalize(merged, norm_weight_ptr, norm_eps, HEAD_DIM)
    cos_sin_row = cos_sin_ptr + (position // RATIO) * RATIO * stride_cos_sin
    # The NoPE dims come back from the rotation unchanged: bf16 of the normalized values
    # (upstream's quant input), and bf16 of the rotated RoPE values (its stored ones).
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
        FP8_ENCODER,
    )


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
    SCAN: tl.constexpr,
    FP8_ENCODER: tl.constexpr,
):
    """Program p finishes the rows of the closing tokens among tokens p * SCAN.."""
    first_token = tl.program_id(0).to(tl.int64) * SCAN
    if SCAN == 1:  # straight-line code: the scan's loop costs 8% at one token a program
        position, cache_slot, closes = closing_token(positions_ptr, state_slots_ptr,
                                                     cache_slots_ptr, first_token, RATIO)
        if closes:
            compress_row(first_token, position, cache_slot,
                         state_ptr, token_to_req_ptr, block_table_ptr, norm_weight_ptr,
                         cos_sin_ptr, cache_ptr, merged_ptr, norm_eps, state_block_size,
                         stride_state_block, stride_state_row, stride_table_req, stride_cos_sin,
                         cache_block_stride, CACHE_BLOCK_SIZE, STATE_WIDTH, RATIO, OVERLAP,
                         ROW_CHUNK, FP8_ENCODER)
    else:
        tokens, closes = closing_tokens(positions_ptr, state_slots_ptr, cache_slots_ptr,
                                        first_token, num_tokens, SCAN, RATIO)
        for _ in range(tl.sum(closes.to(tl.int32))):
            token, closes = next_closing(tokens, closes, num_tokens)
            compress_row(token, tl.load(positions_ptr + token),
                         tl.load(cache_slots_ptr + token).to(tl.int64),
                         state_ptr, token_to_req_ptr, block_table_ptr, norm_weight_ptr,
                         cos_sin_ptr, cache_ptr, merged_ptr, norm_eps, state_block_size,
                         stride_state_block, stride_state_row, stride_table_req, stride_cos_sin,
                         cache_block_stride, CACHE_BLOCK_SIZE, STATE_WIDTH, RATIO, OVERLAP,
                         ROW_CHUNK, FP8_ENCODER)


def tokens_a_program(num_tokens: int, num_requests: int, compress_ratio: int) -> int:
    """SCAN (module doc): a program meets at most this many requests, so at most this many
    windows when they all close in the same step."""
    if compress_ratio == 4:
        return 1
    scan = min(MAX_SCAN, tokens_per_request(num_tokens, num_requests))
    fewest = triton.next_power_of_2(triton.cdiv(num_tokens, MAX_GRID_Y))
    return max(scan, fewest)


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
    scan = tokens_a_program(num_tokens, block_table.shape[0], compress_ratio)
    merged = None
    if compress_ratio == 128:
        merged = merge_windows(state_cache, token_to_req_indices, positions, slot_mapping,
                               block_table, kv_slot_mapping, scan)
    _kv_compress_kernel[(triton.cdiv(num_tokens, scan),)](
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
        SCAN=scan,
        FP8_ENCODER=fp8_encoder(kv_cache.device),
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
