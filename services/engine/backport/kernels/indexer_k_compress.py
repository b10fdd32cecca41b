"""Indexer K: compress + RMSNorm + RoPE + fp8 quant + insert into the indexer cache.

Replaces upstream's fp8 indexer kernel `_fused_kv_compress_norm_rope_insert_indexer_attn`
(deepseek_v4/common/ops/fused_compress_quant_cache.py), which casts with
`tl.float8e4nv`. Same inputs and outputs (head_dim 128, one quant block per row):

- state_cache [num_state_blocks, state_block_size, 2 * state_width] fp32: per token the
  compressor's kv values then its scores (scores start at `state_width`); with overlap
  (compress ratio 4) each half holds two 128-dim sets, the previous window's and this
  window's;
- a token at position p with (p + 1) % ratio == 0 closes a window: the (1 + overlap) *
  ratio state rows ending at p (positions < 0 skipped) are merged per dim with softmax
  weights over their scores (rows of the older window read the first 128-dim set, rows
  of the current window the second), RMS-normalized with `rms_norm_weight`, rotated
  (GPT-J pairs in the last rope dims, at position (p // ratio) * ratio), rounded to
  bf16, and quantized with one fp32 power-of-two scale (floor 1e-4);
- the result goes to kv_slot_mapping[t] of the indexer cache, whose page is
  [block_size x 128 fp8 bytes][block_size x 4 B fp32 scales][padding].
Tokens whose state slot or cache slot is -1, or that close no window, write nothing.

Tiling: a program scans SCAN consecutive tokens with one vector load and finishes each
closing one in turn (`tokens_a_program`): in a prefill, a window's tokens or two ratio-4
windows', so that every program has a window to merge (one program a token left three in
four loading four scalars and stopping, which on sm86's 16 blocks an SM kept a quarter of
them reading); in a decode step, where any token may close a window, one. A window's rows
are merged ROW_CHUNK rows at a time: the ratio-4 window (8 x 128) in one piece on one warp, the
ratio-128 one (128 x 128) 32 rows a step on four warps, which keeps it in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
from services.engine.backport.kernels.fp8_e4m3 import (
    E4M3_MAX,
    e4m3_quantize_bf16,
    e4m3_scale_exponent,
    exp2_int,
    fp8_encoder,
    round_to_bf16,
)

AMAX_FLOOR = tl.constexpr(1e-4)  # upstream's floor before picking a scale
SCALE_BYTES = 4  # one fp32 scale per cached row
# Rows a merge step: the whole ratio-4 window (8 rows, 64 fp32 values a thread on one warp;
# H200 sm80 mode, T=131072, 8 tokens a program: 0.0826 ms on 1 warp, 0.108 on 2, 0.277 on
# 4), a quarter of the ratio-128 window (32 rows on four warps: the whole [128, 128] window
# on four warps spilled).
SMALL_WINDOW_ROWS = 8
LARGE_WINDOW_ROW_CHUNK = 32
# Tokens a prefill's program scans at least: two ratio-4 windows (H200, T=131072, graph
# replays, 1 / 4 / 8 / 16 tokens: sm80 mode 0.0908 / 0.0841 / 0.0826 / 0.0853 ms, sm86 mode
# on 88 SMs 0.1418 / 0.1166 / 0.1143 / 0.1157).
MIN_SCAN = 8


@triton.jit
def compress_indexer_row(
    request,
    position,
    cache_slot,
    state_ptr,
    block_table_ptr,
    norm_weight_ptr,
    cos_sin_ptr,
    cache_ptr,
    norm_eps,
    state_block_size,
    stride_state_block,
    stride_state_row,
    stride_table_req,
    stride_cos_sin,
    cache_block_size,
    cache_block_stride,
    HEAD_DIM: tl.constexpr,
    STATE_WIDTH: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    HALF_ROPE: tl.constexpr,
    FP8_ENCODER: tl.constexpr,
):
    """Merge, normalize, rotate, quantize and insert the row of the window ending at
    `position`."""
    merged = merge_window(state_ptr, block_table_ptr + request * stride_table_req, position, 0,
                          state_block_size, stride_state_block, stride_state_row, HEAD_DIM,
                          HEAD_DIM, STATE_WIDTH, RATIO, OVERLAP, ROW_CHUNK)
    normed = rms_normalize(merged, norm_weight_ptr, norm_eps, HEAD_DIM)

    # GPT-J RoPE on the last 2 * HALF_ROPE dims at the window's first position.
    cos_sin_row = cos_sin_ptr + (position // RATIO) * RATIO * stride_cos_sin
    rotated = gptj_rotate(normed, cos_sin_row, HEAD_DIM, HALF_ROPE)
    rotated = round_to_bf16(rotated)

    # One power-of-two scale for the row; fp8 bytes then the fp32 scale.
    exponent = e4m3_scale_exponent(tl.maximum(tl.max(tl.abs(rotated), axis=0), AMAX_FLOOR))
    page = cache_ptr + (cache_slot // cache_block_size) * cache_block_stride
    in_page = cache_slot % cache_block_size
    fp8_bytes = e4m3_quantize_bf16(rotated, exponent, FP8_ENCODER)
    tl.store(page + in_page * HEAD_DIM + tl.arange(0, HEAD_DIM), fp8_bytes)
    scale_ptr = (page + cache_block_size * HEAD_DIM + in_page * 4).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr, exp2_int(exponent))


@triton.jit
def _indexer_k_compress_kernel(
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
    num_tokens,
    cache_block_size,
    cache_block_stride,
    HEAD_DIM: tl.constexpr,
    STATE_WIDTH: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    HALF_ROPE: tl.constexpr,
    SCAN: tl.constexpr,
    FP8_ENCODER: tl.constexpr,
):
    """Program p finishes the rows of the closing tokens among tokens p * SCAN.."""
    first_token = tl.program_id(0).to(tl.int64) * SCAN
    if SCAN == 1:
        # The token's four scalars in one round trip to memory.
        request = tl.load(token_to_req_ptr + first_token).to(tl.int64)
        position, cache_slot, closes = closing_token(positions_ptr, state_slots_ptr,
                                                     cache_slots_ptr, first_token, RATIO)
        if closes:
            compress_indexer_row(request, position, cache_slot, state_ptr, block_table_ptr,
                                 norm_weight_ptr, cos_sin_ptr, cache_ptr, norm_eps,
                                 state_block_size, stride_state_block, stride_state_row,
                                 stride_table_req, stride_cos_sin, cache_block_size,
                                 cache_block_stride, HEAD_DIM, STATE_WIDTH, RATIO, OVERLAP,
                                 ROW_CHUNK, HALF_ROPE, FP8_ENCODER)
    else:
        tokens, closes = closing_tokens(positions_ptr, state_slots_ptr, cache_slots_ptr,
                                        first_token, num_tokens, SCAN, RATIO)
        for _ in range(tl.sum(closes.to(tl.int32))):
            token, closes = next_closing(tokens, closes, num_tokens)
            compress_indexer_row(tl.load(token_to_req_ptr + token).to(tl.int64),
                                 tl.load(positions_ptr + token),
                                 tl.load(cache_slots_ptr + token).to(tl.int64),
                                 state_ptr, block_table_ptr, norm_weight_ptr, cos_sin_ptr,
                                 cache_ptr, norm_eps, state_block_size, stride_state_block,
                                 stride_state_row, stride_table_req, stride_cos_sin,
                                 cache_block_size, cache_block_stride, HEAD_DIM, STATE_WIDTH,
                                 RATIO, OVERLAP, ROW_CHUNK, HALF_ROPE, FP8_ENCODER)


def tokens_a_program(num_tokens: int, num_requests: int, compress_ratio: int) -> int:
    """SCAN (module doc): a window's tokens (two windows' at ratio 4), fewer when the batch has
    fewer tokens a request, so that a program meets few windows that close in one step."""
    return min(max(compress_ratio, MIN_SCAN), tokens_per_request(num_tokens, num_requests))


def indexer_k_compress_insert(
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
    head_dim: int = 128,
    rope_head_dim: int = 64,
) -> None:
    """Compress, normalize, rotate, quantize and insert indexer K rows (module doc)."""
    state_width = checked_state_width(state_cache, compress_ratio, head_dim)
    overlap = compress_ratio == 4
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() < 2:
        raise ValueError("kv_cache must be uint8 [num_blocks, block_size, ...]")
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    window = (1 + overlap) * compress_ratio
    scan = tokens_a_program(num_tokens, block_table.shape[0], compress_ratio)
    _indexer_k_compress_kernel[(triton.cdiv(num_tokens, scan),)](
        *window_kernel_args(state_cache, token_to_req_indices, positions, slot_mapping,
                            block_table, rms_norm_weight, cos_sin_cache, kv_cache,
                            kv_slot_mapping, rms_norm_eps),
        num_tokens,
        kv_cache.shape[1],
        kv_cache.stride(0),
        HEAD_DIM=head_dim,
        STATE_WIDTH=state_width,
        RATIO=compress_ratio,
        OVERLAP=int(overlap),
        ROW_CHUNK=window if window <= SMALL_WINDOW_ROWS else LARGE_WINDOW_ROW_CHUNK,
        HALF_ROPE=rope_head_dim // 2,
        SCAN=scan,
        FP8_ENCODER=fp8_encoder(kv_cache.device),
        num_warps=1 if window <= SMALL_WINDOW_ROWS else 4,
    )


def indexer_k_compress_insert_reference(
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
    head_dim: int = 128,
    rope_head_dim: int = 64,
) -> None:
    """torch reference of `indexer_k_compress_insert` (one token at a time)."""
    cache_block_size = kv_cache.shape[1]
    flat_cache = kv_cache.as_strided((kv_cache.shape[0] * kv_cache.stride(0),), (1,))
    for token in range(positions.shape[0]):
        position = int(positions[token])
        if (
            int(slot_mapping[token]) < 0
            or (position + 1) % compress_ratio
            or int(kv_slot_mapping[token]) < 0
        ):
            continue
        block_table_row = block_table[int(token_to_req_indices[token])]
        merged = merge_window_reference(
            state_cache, block_table_row, position, compress_ratio, head_dim
        )
        normed = rms_normalize_reference(merged, rms_norm_weight, rms_norm_eps)
        rope_position = (position // compress_ratio) * compress_ratio
        rotated = gptj_rotate_reference(normed, cos_sin_cache[rope_position], rope_head_dim)
        row_values = rotated.to(torch.bfloat16).float()
        amax = row_values.abs().max().double().clamp(min=1e-4)
        scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX))).float()
        fp8 = (
            (row_values / scale)
            .clamp(-E4M3_MAX, E4M3_MAX)
            .to(torch.float8_e4m3fn)
            .view(torch.uint8)
        )
        slot = int(kv_slot_mapping[token])
        page = (slot // cache_block_size) * kv_cache.stride(0)
        in_page = slot % cache_block_size
        flat_cache[page + in_page * head_dim : page + (in_page + 1) * head_dim] = fp8
        scale_at = page + cache_block_size * head_dim + in_page * SCALE_BYTES
        flat_cache[scale_at : scale_at + SCALE_BYTES] = scale.reshape(1).view(torch.uint8)
