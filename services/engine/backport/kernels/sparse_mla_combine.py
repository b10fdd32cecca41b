"""Combine step of the split-K sparse MLA decode.

Each split s of a (token, head) produced a normalized partial output o_s and the
log-sum-exp lse_s (base 2) of its scores; -inf when it saw no valid key. The full
result is sum_s w_s * o_s with w_s = 2**(lse_s - lse), lse = log2(sum_s 2**lse_s).

Attention sink (DeepSeek-V4, as FlashMLA applies it): a per-head logit that joins the
softmax denominator but has no value row, so out *= 2**lse / (2**lse + e**sink).
The returned lse is natural-log and excludes the sink; a query with no valid key
gets out = 0 and lse = +inf (FlashMLA's convention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels.online_softmax import natural_lse

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def apply_sink(out, lse2, sink_ptr, heads, head_mask):
    """Scale normalized outputs [heads, D] by 2**lse2 / (2**lse2 + e**sink).

    Written as 1 / (1 + 2**(sink * log2(e) - lse2)) so that lse2 = -inf gives 0, also
    against a sink of -inf (FlashMLA takes +-inf sinks), where the exponent is NaN.
    """
    sink = tl.load(sink_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    keep = 1.0 / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2))
    return out * tl.where(lse2 == float("-inf"), 0.0, keep)[:, None]


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
    # Program ids: one head of one token, DIM_BLOCK of its output dims. The splits are an
    # unrolled loop of independent [DIM_BLOCK] loads, so they are in flight together, and
    # each thread sums its own dims: a [splits, dims] tile reduced over splits made Triton
    # spread bf16 partials' splits over warps and reduce through shared memory (H200, sm80
    # mode, B=128 H=16, 2 splits: 11.7 us against 3.5 for fp32).
    head = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    dim_block = tl.program_id(2)
    splits = tl.arange(0, MAX_SPLITS)
    dims = dim_block * DIM_BLOCK + tl.arange(0, DIM_BLOCK)
    lse_row = partial_lse_ptr + token * stride_pl_token + head

    # Split weights from the partial log-sum-exps (base 2).
    split_lse = tl.load(lse_row + splits * stride_pl_split, mask=splits < num_splits,
                        other=float("-inf"))
    lse_max = tl.max(split_lse, axis=0)
    lse_max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight_sum = tl.sum(tl.exp2(split_lse - lse_max_safe), axis=0)
    has_keys = weight_sum > 0
    lse2 = tl.where(
        has_keys, lse_max_safe + tl.log2(tl.where(has_keys, weight_sum, 1.0)), float("-inf")
    )
    inverse_sum = 1.0 / tl.where(has_keys, weight_sum, 1.0)

    # Weighted sum of the partial outputs.
    part_row = partial_out_ptr + token * stride_po_token + head * stride_po_head + dims
    acc = tl.zeros([DIM_BLOCK], dtype=tl.float32)
    for split in tl.static_range(MAX_SPLITS):
        # Masked by the split count alone, not by the weight, so no load waits for another:
        # a split without keys holds zeros and gets weight 0. Its lse is read again as a
        # scalar: picking it out of `split_lse` would be a reduction across threads.
        part = tl.load(part_row + split * stride_po_split,
                       mask=tl.full([DIM_BLOCK], split, tl.int32) < num_splits, other=0.0)
        part_lse = tl.load(lse_row + split * stride_pl_split,
                           mask=tl.full([], split, tl.int32) < num_splits, other=float("-inf"))
        acc += part.to(tl.float32) * (tl.exp2(part_lse - lse_max_safe) * inverse_sum)

    # Write-back: sink, output in out's dtype, natural-log lse.
    if HAS_SINK:
        sink = tl.load(sink_ptr + head).to(tl.float32)
        keep = 1.0 / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2))
        acc = acc * tl.where(has_keys, keep, 0.0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        acc.to(out_ptr.dtype.element_ty),
    )
    if dim_block == 0:
        tl.store(lse_ptr + token * num_heads + head, natural_lse(lse2, has_keys))


def combine_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    attn_sink: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """partial_out [T, S, H, D] fp32 or bf16, partial_lse [T, S, H] fp32 base-2 -> out
    [T, H, D], lse [T, H]. A split without keys (lse -inf) must hold finite partials: both
    decodes write zeros there."""
    num_tokens, num_splits, num_heads, head_dim = partial_out.shape
    max_splits = triton.next_power_of_2(num_splits)
    # Keep the loads a program has in flight at 4096 values (32 registers a thread at 4 warps).
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
        out = out * torch.sigmoid(lse - attn_sink.float()).nan_to_num(0.0).unsqueeze(-1)
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))
