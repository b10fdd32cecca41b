"""Quantize bf16 K rows to fp8_ds_mla and insert them into the paged cache.

Replaces upstream's `quantize_and_insert_k_cache` (deepseek_v4/common/ops/
cache_utils.py), which casts with `tl.float8e4nv` and so needs sm89+. Same inputs and
outputs: K [num_tokens, 512] bf16, a uint8 cache laid out as `ds_mla_cache` describes,
slot_mapping [num_tokens'] (-1 = skip; num_tokens' <= num_tokens, upstream's DP padding).

Per 64-dim tile the scale is 2**e with e = ceil(log2(max(amax, 1e-4) / 448)), found
from the float's bits (`e4m3_scale_exponent`); the tile is multiplied by 2**-e (exact)
and encoded with `e4m3_quantize_bf16`. The reference is `ds_mla_cache.insert_rows_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.fp8_e4m3 import (
    e4m3_quantize_bf16,
    e4m3_scale_exponent,
    fp8_encoder,
)

TILES_PER_ROW = 8  # 7 fp8 tiles + the RoPE tile, so a row is one [8, 64] block
AMAX_FLOOR = tl.constexpr(1e-4)  # upstream's floor on a tile's absolute maximum
# Rows a program quantizes (H200, graph replay, 262,144 random slots, sm80 mode: 1 row
# 0.2623 ms, 2: 0.1985, 4: 0.1735, 8: 0.1553, 16: 0.1514; one row a program, as before,
# took 0.2414; sm86 mode the same within 3%).
TOKENS_PER_PROGRAM = 16


@triton.jit
def _quantize_insert_kernel(
    k_ptr,
    slot_ptr,
    cache_ptr,
    num_tokens,
    stride_k_token,
    block_stride,
    BLOCK_SIZE: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    QUANT_TILE: tl.constexpr,
    NUM_NOPE_TILES: tl.constexpr,
    TILES_PER_ROW: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    TOKENS: tl.constexpr,
    FP8_ENCODER: tl.constexpr,
):
    # TOKENS rows a program, each an [8, 64] block of tiles: one row is too little work
    # for a program (TOKENS_PER_PROGRAM).
    token = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + token, mask=token < num_tokens, other=-1).to(tl.int64)
    valid = slot >= 0
    readable_slot = tl.where(valid, slot, 0)

    page = (readable_slot // BLOCK_SIZE) * block_stride
    position = readable_slot % BLOCK_SIZE
    data_offset = page + position * DATA_BYTES
    scale_offset = page + BLOCK_SIZE * DATA_BYTES + position * SCALE_BYTES

    tile = tl.arange(0, TILES_PER_ROW)
    dim = tl.arange(0, QUANT_TILE)
    offsets = (tile[:, None] * QUANT_TILE + dim[None, :])[None, :, :]
    written = valid[:, None, None]
    row = tl.load(
        k_ptr + token[:, None, None] * stride_k_token + offsets, mask=written, other=0.0
    ).to(tl.float32)
    store_ds_mla_rows(cache_ptr, data_offset, scale_offset, row, valid, NOPE_DIM, QUANT_TILE,
                      NUM_NOPE_TILES, TILES_PER_ROW, FP8_ENCODER)


@triton.jit
def store_ds_mla_rows(
    cache_ptr,
    data_offset,
    scale_offset,
    row,
    valid,
    NOPE_DIM: tl.constexpr,
    QUANT_TILE: tl.constexpr,
    NUM_NOPE_TILES: tl.constexpr,
    TILES_PER_ROW: tl.constexpr,
    FP8_ENCODER: tl.constexpr,
):
    """Write rows [R, 8, 64] of bf16-exact fp32 values (7 NoPE tiles, then the RoPE tile)
    as fp8_ds_mla rows at byte offsets data_offset / scale_offset [R]; rows not `valid`
    are skipped."""
    tile = tl.arange(0, TILES_PER_ROW)
    dim = tl.arange(0, QUANT_TILE)
    is_nope = (tile < NUM_NOPE_TILES)[None, :, None]
    offsets = (tile[:, None] * QUANT_TILE + dim[None, :])[None, :, :]
    written = valid[:, None, None]

    # fp8 part: one power-of-two scale per 64-dim tile.
    exponent = e4m3_scale_exponent(tl.maximum(tl.max(tl.abs(row), axis=2), AMAX_FLOOR))
    fp8_bytes = e4m3_quantize_bf16(row, exponent[:, :, None], FP8_ENCODER)
    data = cache_ptr + data_offset[:, None, None]
    tl.store(data + offsets, fp8_bytes, mask=written & is_nope)
    scale_bytes = tl.minimum(tl.maximum(exponent + 127, 0), 255)
    scale_bytes = tl.where(tile[None, :] < NUM_NOPE_TILES, scale_bytes, 0)
    tl.store(
        cache_ptr + scale_offset[:, None] + tile[None, :],
        scale_bytes.to(tl.uint8),
        mask=valid[:, None],
    )

    # RoPE part: the last tile, stored as bf16 right after the fp8 bytes.
    rope = (data + NOPE_DIM).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope + (offsets - NOPE_DIM), row.to(tl.bfloat16), mask=written & ~is_nope)


def quantize_and_insert_k_cache(
    k: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int | None = None,
) -> None:
    """Quantize K [num_tokens, 512] bf16 into `k_cache` at `slot_mapping` (-1 skips)."""
    if k.dim() != 2 or k.shape[1] != layout.HEAD_DIM or k.dtype != torch.bfloat16:
        raise ValueError(f"K must be [num_tokens, 512] bf16, got {tuple(k.shape)} {k.dtype}")
    if k.stride(1) != 1:
        raise ValueError("K rows must be contiguous")
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError("more slots than K rows")
    geometry = layout.cache_geometry(k_cache, block_size)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _quantize_insert_kernel[(triton.cdiv(num_tokens, TOKENS_PER_PROGRAM),)](
        k,
        slot_mapping,
        k_cache,
        num_tokens,
        k.stride(0),
        geometry.block_stride,
        BLOCK_SIZE=geometry.block_size,
        NOPE_DIM=layout.NOPE_DIM,
        QUANT_TILE=layout.QUANT_TILE,
        NUM_NOPE_TILES=layout.NUM_NOPE_TILES,
        TILES_PER_ROW=TILES_PER_ROW,
        DATA_BYTES=layout.DATA_BYTES_PER_TOKEN,
        SCALE_BYTES=layout.SCALE_BYTES_PER_TOKEN,
        TOKENS=TOKENS_PER_PROGRAM,
        FP8_ENCODER=fp8_encoder(k.device),
    )
