"""Torch versions of DeepSeek-V4's lightning-indexer kernels (vLLM `indexer.cpp`,
`paged_mqa_logits.cpp`, `topk.cpp` contracts)."""

from __future__ import annotations

import torch

from services.engine.backport.cpu import fp8_ds_mla as layout
from services.engine.backport.cpu.rope import rotate_gptj

TOPK = 512
# Query rows scored per GEMM: bounds the logits working set (rows x heads x seq).
_ROWS_PER_CHUNK = 256


def fused_indexer_q_rope_quant(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_q_fp8: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    index_weights_out: torch.Tensor,
) -> None:
    """RoPE the last dims, quantize each (token, head) with one power-of-two scale,
    and fold that scale into the head weights (the fp8 query carries none)."""
    rope_dim = index_q_cos_sin_cache.shape[-1]
    nope_dim = index_q.shape[-1] - rope_dim
    q = index_q.to(torch.float32).clone()
    cos_sin = index_q_cos_sin_cache[positions].unsqueeze(1)
    q[..., nope_dim:] = layout.bf16_round(rotate_gptj(q[..., nope_dim:], cos_sin))
    amax = torch.clamp(q.abs().amax(dim=-1), min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / layout.FP8_MAX)))
    index_q_fp8.copy_(
        (q / scale.unsqueeze(-1)).clamp(-layout.FP8_MAX, layout.FP8_MAX).to(torch.float8_e4m3fn)
    )
    index_weights_out.copy_(
        index_weights.to(torch.float32)
        * scale
        * index_weights_softmax_scale
        * index_weights_head_scale
    )


def fp8_paged_mqa_logits(
    q_fp8: torch.Tensor,
    kvcache_fp8: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    max_seq_len: int,
) -> torch.Tensor:
    """logits[b, s] = k_scale * sum_h relu(q[b, h] . k[s]) * weight[b, h], for s < seq_len[b].

    Positions at or past a row's length are -inf (never selected). Rows that
    share a page table (one request's prefill tokens) share one key read.
    """
    batch = q_fp8.shape[0]
    logits = torch.full((batch, max_seq_len), float("-inf"), dtype=torch.float32)
    if batch == 0 or max_seq_len == 0:
        return logits
    q = q_fp8.to(torch.float32)
    lens = seq_lens.to(torch.int64)
    tables, table_of_row = torch.unique(page_table.to(torch.int64), dim=0, return_inverse=True)
    for table_id in range(tables.shape[0]):
        rows = torch.nonzero(table_of_row == table_id).squeeze(-1)
        width = int(lens[rows].max().item())
        if width == 0:
            continue
        position = torch.arange(width)
        logical_page = torch.clamp(
            torch.div(position, block_size, rounding_mode="floor"), max=tables.shape[1] - 1
        )
        keys = layout.read_indexer_records(
            kvcache_fp8, tables[table_id, logical_page], position % block_size, block_size
        )
        for start in range(0, rows.shape[0], _ROWS_PER_CHUNK):
            chunk = rows[start : start + _ROWS_PER_CHUNK]
            heads = q.shape[1]
            dots = (q[chunk].reshape(-1, q.shape[-1]) @ keys.T).clamp(min=0.0)
            scores = (dots.view(chunk.shape[0], heads, width) * weight[chunk].unsqueeze(-1)).sum(1)
            in_range = position.unsqueeze(0) < lens[chunk].unsqueeze(-1)
            logits[chunk, :width] = scores.masked_fill(~in_range, float("-inf"))
    return logits


def topk_transform_512(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: torch.Tensor | None,
) -> None:
    """Pick each row's 512 best positions (all of them, in order, when the row is
    shorter) and translate them to physical slots through the page table; -1 pads."""
    batch, width = scores.shape
    lens = seq_lens.to(torch.int64).unsqueeze(-1)
    ranks = torch.arange(TOPK).unsqueeze(0)
    raw = torch.where(ranks < lens, ranks, -1).expand(batch, TOPK).clone()
    is_long = lens.squeeze(-1) > TOPK
    if bool(is_long.any()):
        masked = scores[is_long].masked_fill(
            torch.arange(width).unsqueeze(0) >= lens[is_long], float("-inf")
        )
        values, picked = torch.topk(masked, k=TOPK, dim=-1, sorted=True)
        raw[is_long] = torch.where(torch.isfinite(values), picked, -1)
    is_valid = raw >= 0
    safe = raw.clamp(min=0)
    physical = torch.gather(
        page_tables.to(torch.int64), 1, torch.div(safe, page_size, rounding_mode="floor")
    )
    out_page_indices.copy_(torch.where(is_valid, physical * page_size + safe % page_size, -1))
    if out_raw_indices is not None:
        out_raw_indices.copy_(raw)
