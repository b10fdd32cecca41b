"""quantize_and_insert_k_cache writes the same bytes as the torch reference."""

from __future__ import annotations

import pytest
import torch

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.k_cache_insert import (
    TOKENS_PER_PROGRAM,
    quantize_and_insert_k_cache,
)

POISON = 0xA5  # bytes the kernel must leave alone where no slot points


def _k_rows(num_tokens: int, generator: torch.Generator) -> torch.Tensor:
    spread = torch.exp2(torch.randint(-10, 10, (num_tokens, 1), generator=generator).float())
    k = torch.randn(num_tokens, layout.HEAD_DIM, generator=generator) * spread
    k[0, : layout.QUANT_TILE] = 0.0  # an all-zero tile takes the 1e-4 floor
    k[1, layout.QUANT_TILE : 2 * layout.QUANT_TILE] *= 1e-30  # a tile of tiny values
    return k.to(torch.bfloat16)


@pytest.mark.parametrize("block_size", [2, 16, 64])
def test_insert_bytes_match_reference(
    kernel_device: str, block_size: int, record_max_error
) -> None:
    generator = torch.Generator().manual_seed(block_size)
    num_blocks = 5
    # More rows than one program takes, the last program part full.
    num_tokens = min(2 * TOKENS_PER_PROGRAM + 8, num_blocks * block_size - 1)
    k = _k_rows(num_tokens, generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[2] = -1
    want = layout.allocate_cache(num_blocks, block_size, "cpu").fill_(POISON)
    layout.insert_rows_reference(k, want, slots, block_size)

    got = torch.full_like(want, POISON).to(kernel_device)
    quantize_and_insert_k_cache(k.to(kernel_device), got, slots.to(kernel_device), block_size)
    mismatched_bytes = int((got.cpu() != want).sum())
    record_max_error("_quantize_insert_kernel", float(mismatched_bytes))
    assert mismatched_bytes == 0

    rows = layout.read_rows_reference(want, slots, block_size)
    kept = slots >= 0
    relative = (rows[kept] - k[kept].float()).norm() / k[kept].float().norm()
    assert relative < 0.06  # fp8 e4m3 with power-of-two scales: a few percent


def test_insert_accepts_flashmla_shaped_view(kernel_device: str) -> None:
    generator = torch.Generator().manual_seed(7)
    block_size, num_blocks = 64, 3
    cache = layout.allocate_cache(num_blocks, block_size, kernel_device)
    view = cache.as_strided(
        (num_blocks, block_size, 1, layout.BYTES_PER_TOKEN),
        (cache.stride(0), layout.BYTES_PER_TOKEN, layout.BYTES_PER_TOKEN, 1),
    )
    k = _k_rows(8, generator).to(kernel_device)
    slots = torch.tensor([0, 63, 64, 100, 191, -1, 5, 6], device=kernel_device)
    quantize_and_insert_k_cache(k, view, slots)
    want = layout.allocate_cache(num_blocks, block_size, "cpu")
    layout.insert_rows_reference(k.cpu(), want, slots.cpu(), block_size)
    assert torch.equal(cache.cpu(), want)
