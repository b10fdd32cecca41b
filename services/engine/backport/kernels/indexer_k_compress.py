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

Tiling: one program per token; the window's rows are one [(1 + overlap) * ratio, 128]
tile, so the softmax and the sum over rows are in-register reductions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
# Warps a program: one for the ratio-4 window (8 x 128 values; three of four programs exit
# after their scalars; H200 sm80 mode, T=16384: 0.0219 ms with 1 warp, 0.0249 with 2, 0.046
# with 4), four for the ratio-128 window (128 x 128), which spills 3.8 KB on one warp.
SMALL_WINDOW_ROWS = 8


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
    cache_block_size,
    cache_block_stride,
    HEAD_DIM: tl.constexpr,
    STATE_WIDTH: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    HALF_ROPE: tl.constexpr,
    FP8_ENCODER: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # The token's four scalars in one round trip to memory: most programs (all but one
    # token in RATIO) stop right after them.
    request = tl.load(token_to_req_ptr + token).to(tl.int64)
    position, cache_slot, closes = closing_token(positions_ptr, state_slots_ptr,
                                                 cache_slots_ptr, token, RATIO)
    if not closes:
        return

    # The window's state rows through the request's block table, merged and normalized.
    merged = merge_window(state_ptr, block_table_ptr + request * stride_table_req, position, 0,
                          state_block_size, stride_state_block, stride_state_row, HEAD_DIM,
                          HEAD_DIM, STATE_WIDTH, RATIO, OVERLAP, (1 + OVERLAP) * RATIO)
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
    _indexer_k_compress_kernel[(num_tokens,)](
        *window_kernel_args(state_cache, token_to_req_indices, positions, slot_mapping,
                            block_table, rms_norm_weight, cos_sin_cache, kv_cache,
                            kv_slot_mapping, rms_norm_eps),
        kv_cache.shape[1],
        kv_cache.stride(0),
        HEAD_DIM=head_dim,
        STATE_WIDTH=state_width,
        RATIO=compress_ratio,
        OVERLAP=int(overlap),
        HALF_ROPE=rope_head_dim // 2,
        FP8_ENCODER=fp8_encoder(kv_cache.device),
        num_warps=1 if (1 + overlap) * compress_ratio <= SMALL_WINDOW_ROWS else 4,
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
