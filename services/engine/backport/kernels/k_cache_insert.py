"""Quantize bf16 K rows to fp8_ds_mla and insert them into the paged cache.

Replaces upstream's `quantize_and_insert_k_cache` (deepseek_v4/common/ops/
cache_utils.py), which casts with `tl.float8e4nv` and so needs sm89+. Same inputs and
outputs: K [num_tokens, 512] bf16, a uint8 cache laid out as `ds_mla_cache` describes,
slot_mapping [num_tokens'] (-1 = skip; num_tokens' <= num_tokens, upstream's DP padding).

Per 64-dim tile the scale is 2**e with e = ceil(log2(max(amax, 1e-4) / 448)), found
from the float's bits rather than `log2` + `ceil` (whose approximate lowering can land
one power of two low); the tile is multiplied by 2**-e (exact) and encoded with
`e4m3_encode`. The reference is `ds_mla_cache.insert_rows_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.fp8_e4m3 import e4m3_encode

TILES_PER_ROW = 8  # 7 fp8 tiles + the RoPE tile, so a row is one [8, 64] block


@triton.jit
def ue8m0_exponent(tile_amax):
    """ceil(log2(max(amax, 1e-4) / 448)) from the bits of amax, exactly.

    With amax = m * 2**E (1 <= m < 2) and 448 = 1.75 * 2**8, amax / 448 lies in
    (2**(E-9), 2**(E-8)] when m <= 1.75 and in (2**(E-8), 2**(E-7)) otherwise.
    """
    amax = tl.maximum(tile_amax, 1e-4)
    bits = amax.to(tl.int32, bitcast=True)
    biased_exponent = (bits >> 23) & 0xFF
    above_1_75 = (bits & 0x7FFFFF) > 0x600000
    return biased_exponent - 127 - 8 + above_1_75.to(tl.int32)


@triton.jit
def _quantize_insert_kernel(
    k_ptr,
    slot_ptr,
    cache_ptr,
    stride_k_token,
    block_stride,
    BLOCK_SIZE: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    QUANT_TILE: tl.constexpr,
    NUM_NOPE_TILES: tl.constexpr,
    TILES_PER_ROW: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    # One program per token: a row is 512 values, too little to share.
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return

    page = cache_ptr + (slot // BLOCK_SIZE) * block_stride
    position = slot % BLOCK_SIZE
    data_ptr = page + position * DATA_BYTES
    scale_ptr = page + BLOCK_SIZE * DATA_BYTES + position * SCALE_BYTES

    tile = tl.arange(0, TILES_PER_ROW)
    dim = tl.arange(0, QUANT_TILE)
    is_nope = (tile < NUM_NOPE_TILES)[:, None]
    offsets = tile[:, None] * QUANT_TILE + dim[None, :]
    row = tl.load(k_ptr + token * stride_k_token + offsets).to(tl.float32)

    # fp8 part: one power-of-two scale per 64-dim tile.
    exponent = ue8m0_exponent(tl.max(tl.abs(row), axis=1))
    inverse_scale = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    fp8_bytes = e4m3_encode(row * inverse_scale[:, None])
    tl.store(data_ptr + offsets, fp8_bytes, mask=is_nope)
    scale_bytes = tl.minimum(tl.maximum(exponent + 127, 0), 255)
    scale_bytes = tl.where(tile < NUM_NOPE_TILES, scale_bytes, 0)
    tl.store(scale_ptr + tile, scale_bytes.to(tl.uint8))

    # RoPE part: the last tile, stored as bf16 right after the fp8 bytes.
    rope_ptr = (data_ptr + NOPE_DIM).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_ptr + (offsets - NOPE_DIM), row.to(tl.bfloat16), mask=~is_nope)


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
    _quantize_insert_kernel[(num_tokens,)](
        k,
        slot_mapping,
        k_cache,
        k.stride(0),
        geometry.block_stride,
        BLOCK_SIZE=geometry.block_size,
        NOPE_DIM=layout.NOPE_DIM,
        QUANT_TILE=layout.QUANT_TILE,
        NUM_NOPE_TILES=layout.NUM_NOPE_TILES,
        TILES_PER_ROW=TILES_PER_ROW,
        DATA_BYTES=layout.DATA_BYTES_PER_TOKEN,
        SCALE_BYTES=layout.SCALE_BYTES_PER_TOKEN,
    )
