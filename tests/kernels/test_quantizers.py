"""The DeepSeek-V4 quantizers and the prefill K gather against their torch references."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.indexer_q_quant import (
    fused_indexer_q_rope_quant,
    fused_indexer_q_rope_quant_reference,
)
from services.engine.backport.kernels.inv_rope_fp8_quant import (
    fused_inv_rope_fp8_quant,
    fused_inv_rope_fp8_quant_reference,
)
from services.engine.backport.kernels.k_cache_gather import (
    dequantize_and_gather_k_cache,
    dequantize_and_gather_k_cache_reference,
)

ROPE_DIM = 64
MAX_POSITION = 4096


def _cos_sin_cache(device: str) -> torch.Tensor:
    """GPT-J style table [max_pos, 64]: cos of the 32 frequencies, then their sin."""
    inverse_frequency = 1.0 / (10000 ** (torch.arange(0, ROPE_DIM, 2).float() / ROPE_DIM))
    angles = torch.arange(MAX_POSITION).float().unsqueeze(1) * inverse_frequency
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(device)


def _byte_mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    return int(
        (
            got.cpu().contiguous().view(torch.uint8) != want.cpu().contiguous().view(torch.uint8)
        ).sum()
    )


@pytest.mark.parametrize("num_heads", [8, 64])
def test_indexer_q_rope_quant(kernel_device: str, num_heads: int, record_max_error) -> None:
    generator = torch.Generator().manual_seed(num_heads)
    num_tokens = 37 if kernel_device == "cuda" else 5
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=generator)
    index_q = (torch.randn(num_tokens, num_heads, 128, generator=generator) * 3).to(torch.bfloat16)
    weights = torch.randn(num_tokens, num_heads, generator=generator).to(torch.bfloat16)
    cos_sin = _cos_sin_cache("cpu")
    args = (0.088, num_heads**-0.5)
    q_fp8, weights_out = fused_indexer_q_rope_quant(
        positions.to(kernel_device),
        index_q.to(kernel_device),
        cos_sin.to(kernel_device),
        weights.to(kernel_device),
        *args,
    )
    want_q, want_weights = fused_indexer_q_rope_quant_reference(
        positions, index_q, cos_sin, weights, *args
    )
    mismatches = _byte_mismatches(q_fp8, want_q)
    weight_error = (weights_out.cpu() - want_weights).abs().max().item()
    record_max_error("_indexer_q_kernel", max(float(mismatches), weight_error))
    assert mismatches == 0
    assert weight_error <= 1e-6 * want_weights.abs().max().item()


@pytest.mark.parametrize("quantize", [True, False])
def test_inv_rope_fp8_quant(kernel_device: str, quantize: bool, record_max_error) -> None:
    generator = torch.Generator().manual_seed(5)
    num_tokens, n_groups, heads_per_group = (13, 4, 8) if kernel_device == "cuda" else (3, 2, 2)
    o = torch.randn(num_tokens, n_groups * heads_per_group, 512, generator=generator).to(
        torch.bfloat16
    )
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=generator)
    cos_sin = _cos_sin_cache("cpu")
    output, scales = fused_inv_rope_fp8_quant(
        o.to(kernel_device),
        positions.to(kernel_device),
        cos_sin.to(kernel_device),
        n_groups,
        heads_per_group,
        quantize=quantize,
    )
    want, want_scales = fused_inv_rope_fp8_quant_reference(
        o, positions, cos_sin, n_groups, heads_per_group
    )
    assert output.shape == (num_tokens, n_groups, heads_per_group * 512)
    if not quantize:
        rotated = output.float().cpu().reshape(num_tokens, n_groups, -1, 128)
        dequantized = want.float().reshape(num_tokens, n_groups, -1, 128) * want_scales.unsqueeze(
            -1
        )
        relative = ((rotated - dequantized).norm() / rotated.norm()).item()
        assert relative < 0.06  # the rotation agrees with the reference up to fp8 rounding
        return
    assert scales.shape == (num_tokens, n_groups, heads_per_group * 4)
    assert scales.stride(0) == 1  # MN-major, as DeepGEMM reads scales
    mismatches = _byte_mismatches(output, want)
    record_max_error("_inv_rope_quant_kernel", float(mismatches))
    assert mismatches == 0
    assert torch.equal(scales.cpu(), want_scales)


@pytest.mark.parametrize("with_gather_lens", [True, False])
def test_dequantize_and_gather_k_cache(
    kernel_device: str, with_gather_lens: bool, record_max_error
) -> None:
    generator = torch.Generator().manual_seed(9)
    block_size, num_blocks = 16, 24
    cache = layout.allocate_cache(num_blocks, block_size, "cpu")
    rows = torch.randn(num_blocks * block_size, layout.HEAD_DIM, generator=generator).to(
        torch.bfloat16
    )
    layout.insert_rows_reference(rows, cache, torch.arange(num_blocks * block_size), block_size)
    seq_lens = torch.tensor([40, 7, 64], dtype=torch.int32)
    gather_lens = torch.tensor([20, 7, 33], dtype=torch.int32) if with_gather_lens else None
    max_blocks = math.ceil(64 / block_size)
    block_table = (
        torch.randperm(num_blocks, generator=generator)[: 3 * max_blocks]
        .view(3, max_blocks)
        .to(torch.int32)
    )
    offset = 5
    want = torch.full((3, offset + 64 + 3, layout.HEAD_DIM), -7.0, dtype=torch.bfloat16)
    got = want.clone().to(kernel_device)
    dequantize_and_gather_k_cache_reference(
        want, cache, seq_lens, gather_lens, block_table, block_size, offset
    )
    dequantize_and_gather_k_cache(
        got,
        cache.to(kernel_device),
        seq_lens.to(kernel_device),
        gather_lens.to(kernel_device) if gather_lens is not None else None,
        block_table.to(kernel_device),
        block_size,
        offset,
    )
    error = (got.cpu().float() - want.float()).abs().max().item()
    record_max_error("_gather_kernel", error)
    assert error == 0.0
