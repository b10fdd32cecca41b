"""Combine step of the split-K sparse MLA decode.

Each split s of a (token, head) produced a normalized partial output o_s and the
log-sum-exp lse_s (base 2) of its scores; -inf when it saw no valid key. The full
result is sum_s w_s * o_s with w_s = 2**(lse_s - lse), lse = log2(sum_s 2**lse_s).

Attention sink (DeepSeek-V4, as FlashMLA applies it): a per-head logit that joins the
softmax denominator but has no value row, so out *= 2**lse / (2**lse + e**sink).
The returned lse is natural-log and excludes the sink; a query with no valid key
gets out = 0 and lse = -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def apply_sink(out, lse2, sink_ptr, heads, head_mask):
    """Scale normalized outputs [heads, D] by 2**lse2 / (2**lse2 + e**sink).

    Written as 1 / (1 + 2**(sink * log2(e) - lse2)) so that lse2 = -inf gives 0.
    """
    sink = tl.load(sink_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    keep = 1.0 / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2))
    return out * keep[:, None]


@triton.jit
def _combine_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
    num_heads,
    num_splits,
    stride_po_token,
    stride_po_split,
    stride_po_head,
    stride_pl_token,
    stride_pl_split,
    stride_out_token,
    stride_out_head,
    MAX_SPLITS: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    # Program ids: one head of one token, DIM_BLOCK of its output dims; every split of
    # that slice is one [MAX_SPLITS, DIM_BLOCK] load, so no program walks the splits.
    head = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    dim_block = tl.program_id(2)
    splits = tl.arange(0, MAX_SPLITS)
    dims = dim_block * DIM_BLOCK + tl.arange(0, DIM_BLOCK)
    in_splits = splits < num_splits

    # Split weights from the partial log-sum-exps (base 2).
    split_lse = tl.load(
        partial_lse_ptr + token * stride_pl_token + splits * stride_pl_split + head,
        mask=in_splits,
        other=float("-inf"),
    )
    lse_max = tl.max(split_lse, axis=0)
    lse_max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(split_lse - lse_max_safe)
    weight_sum = tl.sum(weights, axis=0)
    has_keys = weight_sum > 0
    lse2 = tl.where(
        has_keys, lse_max_safe + tl.log2(tl.where(has_keys, weight_sum, 1.0)), float("-inf")
    )
    weights = weights / tl.where(has_keys, weight_sum, 1.0)

    # Weighted sum of the partial outputs.
    part_ptrs = (
        partial_out_ptr
        + token * stride_po_token
        + splits[:, None] * stride_po_split
        + head * stride_po_head
        + dims[None, :]
    )
    parts = tl.load(part_ptrs, mask=(weights > 0)[:, None], other=0.0)
    acc = tl.sum(parts * weights[:, None], axis=0)

    # Write-back: sink, output in out's dtype, natural-log lse.
    if HAS_SINK:
        sink = tl.load(sink_ptr + head).to(tl.float32)
        acc = acc / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2))
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        acc.to(out_ptr.dtype.element_ty),
    )
    if dim_block == 0:
        tl.store(lse_ptr + token * num_heads + head, lse2 * 0.6931471805599453)


def combine_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    attn_sink: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """partial_out [T, S, H, D] fp32, partial_lse [T, S, H] base-2 -> out [T, H, D], lse [T, H]."""
    num_tokens, num_splits, num_heads, head_dim = partial_out.shape
    max_splits = triton.next_power_of_2(num_splits)
    # Keep the [splits, dims] tile at 4096 fp32 values (32 registers a thread at 4 warps).
    dim_block = max(16, min(head_dim, 4096 // max_splits))
    grid = (num_heads, num_tokens, triton.cdiv(head_dim, dim_block))
    _combine_kernel[grid](
        partial_out,
        partial_lse,
        attn_sink if attn_sink is not None else partial_lse,
        out,
        lse,
        num_heads,
        num_splits,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        MAX_SPLITS=max_splits,
        DIM_BLOCK=dim_block,
        HAS_SINK=attn_sink is not None,
        num_warps=4,
    )


def combine_splits_reference(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, attn_sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch reference of `combine_splits` (fp32 out, natural-log lse)."""
    lse = torch.logsumexp(partial_lse * LN2, dim=1)  # [T, H]
    weights = torch.exp(partial_lse * LN2 - lse.unsqueeze(1)).nan_to_num(0.0)
    out = (weights.unsqueeze(-1) * partial_out).sum(dim=1)
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink.float()).unsqueeze(-1)
    return out, lse
