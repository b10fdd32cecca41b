"""Byte layouts of DeepSeek-V4's paged caches on the CPU build, read and written in torch.

Two layouts, both one 2-D uint8 row per cache block (a block's row stride may
exceed its used bytes when the block is a page of a pooled allocation):

- `fp8_ds_mla` (attention and compressed KV, head 512 = 448 NoPE + 64 RoPE):
  `block_size` token records of 576 bytes (448 fp8 e4m3 NoPE values, then 64
  bf16 RoPE values), then `block_size` scale records of 8 bytes (7 UE8M0
  exponents, one per 64-wide NoPE tile, and a pad byte).
- indexer K (head 128): `block_size` records of 128 fp8 values, then
  `block_size` fp32 scales.
"""

from __future__ import annotations

import torch

NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM
QUANT_TILE = 64
NUM_TILES = NOPE_DIM // QUANT_TILE
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM
SCALE_BYTES_PER_TOKEN = 8

INDEXER_HEAD_DIM = 128
INDEXER_SCALE_BYTES = 4

FP8_MAX = 448.0
_SCALE_FLOOR = 1e-4


def to_fp8_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already inside [-448, 448] to e4m3fn bytes (round to nearest even)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def from_fp8_bytes(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def quantize_ue8m0_tiles(nope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 448] fp32 -> ([N, 448] fp8 bytes, [N, 7] UE8M0 exponent bytes).

    Each 64-wide tile gets the smallest power-of-two scale that maps its
    absolute maximum inside the fp8 range.
    """
    tiles = nope.view(-1, NUM_TILES, QUANT_TILE)
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(torch.clamp(amax / FP8_MAX, min=_SCALE_FLOOR)))
    scaled = tiles * torch.exp2(-exponent)
    fp8 = to_fp8_bytes(scaled).view(-1, NOPE_DIM)
    scale_bytes = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return fp8, scale_bytes


def _block_and_offset(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def write_ds_mla_records(
    cache_2d: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    nope: torch.Tensor,
    rope: torch.Tensor,
) -> None:
    """Quantize and store token records at `slots` (all >= 0).

    nope: [N, 448] fp32 (already bf16-rounded where the caller wants it);
    rope: [N, 64] fp32, stored as bf16.
    """
    if slots.numel() == 0:
        return
    fp8, scale_bytes = quantize_ue8m0_tiles(nope)
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    pad = torch.zeros((slots.numel(), 1), dtype=torch.uint8)
    block, offset = _block_and_offset(slots, block_size)
    data_cols = offset.unsqueeze(-1) * TOKEN_DATA_BYTES + torch.arange(TOKEN_DATA_BYTES)
    scale_cols = (
        block_size * TOKEN_DATA_BYTES
        + offset.unsqueeze(-1) * SCALE_BYTES_PER_TOKEN
        + torch.arange(SCALE_BYTES_PER_TOKEN)
    )
    rows = block.unsqueeze(-1)
    cache_2d[rows, data_cols] = torch.cat([fp8, rope_bytes], dim=-1)
    cache_2d[rows, scale_cols] = torch.cat([scale_bytes, pad], dim=-1)


def read_ds_mla_records(cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dequantize token records at `slots` (all >= 0) to [N, 512] fp32."""
    block, offset = _block_and_offset(slots, block_size)
    rows = block.unsqueeze(-1)
    data_cols = offset.unsqueeze(-1) * TOKEN_DATA_BYTES + torch.arange(TOKEN_DATA_BYTES)
    scale_cols = block_size * TOKEN_DATA_BYTES + offset.unsqueeze(-1) * SCALE_BYTES_PER_TOKEN
    data = cache_2d[rows, data_cols]
    exponents = cache_2d[rows, scale_cols + torch.arange(NUM_TILES)].to(torch.float32) - 127
    nope = from_fp8_bytes(data[:, :NOPE_DIM]).view(-1, NUM_TILES, QUANT_TILE)
    nope = (nope * torch.exp2(exponents).unsqueeze(-1)).view(-1, NOPE_DIM)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([nope, rope], dim=-1)


def write_indexer_records(
    cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int, values: torch.Tensor
) -> None:
    """Store [N, 128] fp32 keys with one power-of-two fp32 scale per key."""
    if slots.numel() == 0:
        return
    amax = torch.clamp(values.abs().amax(dim=-1, keepdim=True), min=_SCALE_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    fp8 = to_fp8_bytes(values / scale)
    block, offset = _block_and_offset(slots, block_size)
    rows = block.unsqueeze(-1)
    data_cols = offset.unsqueeze(-1) * INDEXER_HEAD_DIM + torch.arange(INDEXER_HEAD_DIM)
    scale_cols = (
        block_size * INDEXER_HEAD_DIM
        + offset.unsqueeze(-1) * INDEXER_SCALE_BYTES
        + torch.arange(INDEXER_SCALE_BYTES)
    )
    cache_2d[rows, data_cols] = fp8
    cache_2d[rows, scale_cols] = scale.to(torch.float32).contiguous().view(torch.uint8)


def read_indexer_records(
    cache_2d: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Dequantize indexer keys at (page, offset) pairs of any shape S to [*S, 128] fp32."""
    rows = pages.unsqueeze(-1)
    data_cols = offsets.unsqueeze(-1) * INDEXER_HEAD_DIM + torch.arange(INDEXER_HEAD_DIM)
    scale_cols = (
        block_size * INDEXER_HEAD_DIM
        + offsets.unsqueeze(-1) * INDEXER_SCALE_BYTES
        + torch.arange(INDEXER_SCALE_BYTES)
    )
    keys = from_fp8_bytes(cache_2d[rows, data_cols])
    scales = cache_2d[rows, scale_cols].contiguous().view(torch.float32)
    return keys * scales
