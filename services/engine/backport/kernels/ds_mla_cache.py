"""The DeepSeek-V4 `fp8_ds_mla` paged KV cache layout and its plain-torch codec.

A K row (K = V in this MQA) has 512 dims: 448 "NoPE" dims stored as fp8 e4m3 with one
UE8M0 (power-of-two) scale per 64 dims, and 64 RoPE dims kept in bf16. Upstream vLLM
0.32 (`v1/attention/backends/mla/flashmla_sparse.py`, `deepseek_v4/common/ops/
cache_utils.py`) stores a page of `block_size` tokens as

    [block_size x 576 B data rows][block_size x 8 B scale rows][pad to a multiple of 576]

data row  = 448 fp8 bytes, then 64 bf16 RoPE values (128 B);
scale row = 7 UE8M0 exponents (scale = 2**(byte - 127)), then one zero pad byte.
That is 584 B per token. (DeepSeek-V3.2's layout is the 656 B row: 512 fp8 values,
4 fp32 scales, 64 bf16; DeepSeek-V4 does not use it.)

Slots are global: slot = physical_block * block_size + position_in_block; -1 = none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
QUANT_TILE = 64  # dims sharing one UE8M0 scale
NUM_NOPE_TILES = NOPE_DIM // QUANT_TILE  # 7
SCALE_BYTES_PER_TOKEN = 8  # 7 exponents + 1 pad byte
DATA_BYTES_PER_TOKEN = NOPE_DIM + ROPE_DIM * 2  # 576
BYTES_PER_TOKEN = DATA_BYTES_PER_TOKEN + SCALE_BYTES_PER_TOKEN  # 584
PAGE_ALIGNMENT = 576  # upstream pads a page to the decode kernel's TMA stride
UE8M0_BIAS = 127
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4  # upstream floors a tile's absolute maximum before picking its scale


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """Where a paged cache's pages sit in memory, in bytes."""

    block_size: int
    block_stride: int

    @property
    def scale_region_offset(self) -> int:
        return self.block_size * DATA_BYTES_PER_TOKEN


def page_bytes(block_size: int) -> int:
    """Bytes of one page of `block_size` tokens, padded as upstream pads it."""
    unpadded = block_size * BYTES_PER_TOKEN
    return -(-unpadded // PAGE_ALIGNMENT) * PAGE_ALIGNMENT


def allocate_cache(num_blocks: int, block_size: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed uint8 cache of shape [num_blocks, page_bytes(block_size)]."""
    return torch.zeros((num_blocks, page_bytes(block_size)), dtype=torch.uint8, device=device)


def cache_geometry(k_cache: torch.Tensor, block_size: int | None = None) -> CacheGeometry:
    """Geometry of a uint8 cache given as [num_blocks, page_bytes] (pass block_size) or
    as a strided view [num_blocks, block_size, (1,) 584] (FlashMLA's shape)."""
    if k_cache.dtype != torch.uint8:
        raise TypeError(f"fp8_ds_mla cache must be uint8, got {k_cache.dtype}")
    if k_cache.stride(-1) != 1:
        raise ValueError("fp8_ds_mla cache rows must be contiguous bytes")
    if k_cache.dim() >= 3:
        shape_block_size = k_cache.shape[1]
        if block_size is not None and block_size != shape_block_size:
            raise ValueError(f"block_size {block_size} != cache shape[1] {shape_block_size}")
        block_size = shape_block_size
    if block_size is None:
        raise ValueError("block_size is required for a 2-D cache")
    if k_cache.stride(0) < block_size * BYTES_PER_TOKEN:
        raise ValueError(f"page stride {k_cache.stride(0)} B too small for {block_size} tokens")
    return CacheGeometry(block_size=block_size, block_stride=k_cache.stride(0))


def ue8m0_exponent_reference(tile_amax: torch.Tensor) -> torch.Tensor:
    """ceil(log2(amax / 448)) in float64, so exact: the tile's power-of-two scale."""
    amax = tile_amax.double().clamp(min=AMAX_FLOOR)
    return torch.ceil(torch.log2(amax / E4M3_MAX)).to(torch.int32)


def quantize_rows_reference(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 K rows [N, 512] -> (576 data bytes [N, 576], 8 scale bytes [N, 8])."""
    if k.shape[-1] != HEAD_DIM:
        raise ValueError(f"K rows must have {HEAD_DIM} dims, got {k.shape[-1]}")
    k = k.to(torch.bfloat16)
    num_rows = k.shape[0]
    nope = k[:, :NOPE_DIM].float().view(num_rows, NUM_NOPE_TILES, QUANT_TILE)
    exponent = ue8m0_exponent_reference(nope.abs().amax(dim=-1))
    scaled = nope * torch.exp2(-exponent.float()).unsqueeze(-1)
    fp8_bytes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    rope_bytes = k[:, NOPE_DIM:].contiguous().view(torch.uint8)
    data = torch.cat([fp8_bytes.view(num_rows, NOPE_DIM), rope_bytes], dim=1)
    scales = torch.zeros((num_rows, SCALE_BYTES_PER_TOKEN), dtype=torch.uint8, device=k.device)
    scales[:, :NUM_NOPE_TILES] = (exponent + UE8M0_BIAS).clamp(0, 255).to(torch.uint8)
    return data, scales


def dequantize_rows_reference(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(data [N, 576], scales [N, 8]) -> fp32 K rows [N, 512], exactly."""
    num_rows = data.shape[0]
    fp8 = data[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    exponent = scales[:, :NUM_NOPE_TILES].to(torch.int32) - UE8M0_BIAS
    nope = fp8.view(num_rows, NUM_NOPE_TILES, QUANT_TILE) * torch.exp2(exponent.float()).unsqueeze(
        -1
    )
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.view(num_rows, NOPE_DIM), rope], dim=1)


def _row_byte_offsets(
    geometry: CacheGeometry, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    slots = slots.to(torch.int64)
    block = slots // geometry.block_size
    position = slots % geometry.block_size
    page = block * geometry.block_stride
    data_offset = page + position * DATA_BYTES_PER_TOKEN
    scale_offset = page + geometry.scale_region_offset + position * SCALE_BYTES_PER_TOKEN
    return data_offset, scale_offset


def insert_rows_reference(
    k: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, block_size: int | None = None
) -> None:
    """Quantize K rows and write them at `slots` (-1 skipped), in place."""
    geometry = cache_geometry(k_cache, block_size)
    keep = slots >= 0
    data, scales = quantize_rows_reference(k[: slots.shape[0]][keep])
    data_offset, scale_offset = _row_byte_offsets(geometry, slots[keep])
    flat = k_cache.as_strided((k_cache.shape[0] * geometry.block_stride,), (1,))
    flat[data_offset.unsqueeze(1) + torch.arange(DATA_BYTES_PER_TOKEN, device=k.device)] = data
    flat[scale_offset.unsqueeze(1) + torch.arange(SCALE_BYTES_PER_TOKEN, device=k.device)] = scales


def read_rows_reference(
    k_cache: torch.Tensor, slots: torch.Tensor, block_size: int | None = None
) -> torch.Tensor:
    """Dequantized fp32 rows [*slots.shape, 512] at `slots`; rows for -1 are zero."""
    geometry = cache_geometry(k_cache, block_size)
    flat_slots = slots.reshape(-1).to(torch.int64)
    valid = flat_slots >= 0
    data_offset, scale_offset = _row_byte_offsets(geometry, flat_slots.clamp(min=0))
    flat = k_cache.as_strided((k_cache.shape[0] * geometry.block_stride,), (1,))
    data = flat[
        data_offset.unsqueeze(1) + torch.arange(DATA_BYTES_PER_TOKEN, device=k_cache.device)
    ]
    scales = flat[
        scale_offset.unsqueeze(1) + torch.arange(SCALE_BYTES_PER_TOKEN, device=k_cache.device)
    ]
    rows = torch.where(valid.unsqueeze(1), dequantize_rows_reference(data, scales), 0.0)
    return rows.view(*slots.shape, HEAD_DIM)
