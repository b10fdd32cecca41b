"""Sparse MLA prefill over gathered bf16 K rows, for sm80/86/89.

Replaces FlashMLA's `flash_mla_sparse_fwd` as DeepSeek-V4 calls it in prefill
(`deepseek_v4/nvidia/flashmla.py`, `_forward_prefill`): a chunk's compressed and
sliding-window cache rows are first dequantized into one bf16 buffer `kv` [S_kv, 1, 512]
(`k_cache_gather`), and every query token attends to its own list of row numbers into
that buffer. K = V (MQA, one KV head), so out has 512 dims per head. FlashMLA runs this
only on sm90/sm100 and wants 64 or 128 heads; here any head count works.

Semantics, the reference being `sparse_mla_prefill_reference` (FlashMLA's definitions):
- valid keys of token t: rows indices[t, i] with 0 <= row < S_kv and i < topk_length[t];
- scores = sm_scale * q . k; out = softmax(scores) . kv over the valid keys;
- attention sink: out *= e**lse / (e**lse + e**sink[h]); a sink of -inf changes nothing,
  +inf zeroes the output; the sink changes neither lse nor max_logits;
- returns out [S_q, H, 512] (q's dtype), max_logits [S_q, H] (the largest score) and
  lse [S_q, H] (natural log); a token with no valid key gets out = 0, max_logits = -inf
  and lse = +inf, as FlashMLA gives.

Tiling:
- a program owns HEADS_PER_PROGRAM heads of one token, so one load of a K row serves
  all of them; the head blocks of a token run side by side and share the rows in L2;
- keys go BLOCK_N at a time: a [BLOCK_N, 512] bf16 tile feeds both dots (q . k^T for the
  scores, p . k for the output) with an online softmax in base 2 between them;
- the loop stops at the token's own list length; row numbers are loaded a block ahead,
  and Triton's pipeliner copies each block's rows into shared memory (cp.async);
- no split-K: a prefill chunk has thousands of tokens, enough programs to fill the card.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.online_softmax import (
    attend_block,
    initial_state,
    natural_lse,
    normalized,
)
from services.engine.backport.kernels.sparse_mla_combine import LOG2E, apply_sink
from services.engine.backport.kernels.sparse_mla_decode import (
    HEAD_DIM,
    as_token_major,
    dot_dtype,
    int32_rows,
)

LN2 = tl.constexpr(0.6931471805599453)  # natural log of 2: base-2 results to base e
# 16 heads a program (tl.dot needs M >= 16) at 4 warps, as the decode; the K tile and
# its pipeline stages are the shared memory: [32, 512] bf16 = 32 KiB a stage. On the H200
# in sm80 mode (S_q=4096) 32 or 64 heads at 8 warps ran 1.3-4.6x slower, 16 or 64 keys a
# step 1.4-1.5x, 2 or 8 warps 1.1-1.4x.
DEFAULT_HEADS_PER_PROGRAM = 16
DEFAULT_BLOCK_N = 32
DEFAULT_NUM_WARPS = 4
# Two stages: one K tile, whose copy for the next block (cp.async) starts once this
# block's dots have read it, so other programs' math is what hides it. 50,176 B: sm86/89's
# 100 KB an SM hold two programs; on an A100 registers do (179 from sm_80's ptxas). One
# stage ran 1.6x slower, three (two K tiles, fewer programs an SM) 1.1x.
DEFAULT_NUM_STAGES = 2


@triton.jit
def _sparse_mla_prefill_kernel(
    q_ptr,
    kv_ptr,
    indices_ptr,
    lengths_ptr,
    sink_ptr,
    out_ptr,
    max_logits_ptr,
    lse_ptr,
    num_heads,
    num_kv_rows,
    list_width,
    qk_scale_log2,
    stride_q_token,
    stride_q_head,
    stride_kv_row,
    stride_indices_token,
    stride_out_token,
    stride_out_head,
    HAS_LENGTHS: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    head_block = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    heads = head_block * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    head_mask = heads < num_heads
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, BLOCK_N)

    # The query block stays in registers for the whole loop.
    q_ptrs = q_ptr + token * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None], other=0.0).to(DOT_DTYPE)

    m_i, l_i, acc = initial_state(HEADS_PER_PROGRAM, HEAD_DIM)

    length = list_width
    if HAS_LENGTHS:
        length = tl.minimum(tl.load(lengths_ptr + token), list_width)
    row_list = indices_ptr + token * stride_indices_token
    # Row numbers are loaded a block ahead into registers, not left to the pipeliner: its
    # shared buffer for them (128 B) put the default tiling at 50,304 B, one block an SM
    # on sm86/89, where two need at most 50,176 B each.
    next_rows = tl.load(row_list + offsets, mask=offsets < length, other=-1)
    for start in tl.range(0, length, BLOCK_N, num_stages=NUM_STAGES):
        rows = next_rows
        ahead = start + BLOCK_N + offsets
        next_rows = tl.load(row_list + ahead, mask=ahead < length, other=-1)
        valid = (rows >= 0) & (rows < num_kv_rows)
        k_ptrs = kv_ptr + tl.where(valid, rows, 0).to(tl.int64)[:, None] * stride_kv_row
        k = tl.load(k_ptrs + dims[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        m_i, l_i, acc = attend_block(q, k, valid, m_i, l_i, acc, qk_scale_log2, DOT_DTYPE)

    out, lse2, has_keys = normalized(acc, m_i, l_i)
    if HAS_SINK:
        out = apply_sink(out, lse2, sink_ptr, heads, head_mask)
    out_ptrs = out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    stats = token * num_heads + heads
    tl.store(max_logits_ptr + stats, m_i * LN2, mask=head_mask)
    tl.store(lse_ptr + stats, natural_lse(lse2, has_keys), mask=head_mask)


def kv_rows(kv: torch.Tensor) -> torch.Tensor:
    """kv as [S_kv, 512] with contiguous rows: FlashMLA's [S_kv, 1, 512] or [S_kv, 512]."""
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"kv must have one KV head, got {tuple(kv.shape)}")
        kv = kv[:, 0]
    if kv.dim() != 2 or kv.shape[-1] != layout.HEAD_DIM or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [S_kv, 1, 512] with contiguous rows, got {tuple(kv.shape)}")
    return kv


def prefill_operands(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Checks q and brings (kv, indices, topk_length) to the kernels' forms: [S_kv, 512]
    rows, [S_q, K] int32 lists, [S_q] int32 lengths."""
    if q.dim() != 3 or q.shape[-1] != layout.HEAD_DIM or q.stride(-1) != 1:
        raise ValueError(f"q must be [S_q, H, 512] with contiguous rows, got {tuple(q.shape)}")
    indices = int32_rows(as_token_major(indices, "indices"))
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices must be [S_q, 1, K], got {tuple(indices.shape)}")
    return kv_rows(kv), indices, int32_rows(topk_length)


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = layout.HEAD_DIM,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    heads_per_program: int = DEFAULT_HEADS_PER_PROGRAM,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill; returns (out [S_q, H, 512], max_logits [S_q, H], lse [S_q, H]).

    q [S_q, H, 512]; kv [S_kv, 1, 512] bf16; indices [S_q, 1, K] (or [S_q, K]) int32/int64
    rows of kv, -1 or >= S_kv = padding; topk_length [S_q]; attn_sink [H] fp32.
    """
    if d_v != layout.HEAD_DIM:
        raise ValueError(f"d_v must be {layout.HEAD_DIM}, got {d_v}")
    kv, indices, topk_length = prefill_operands(q, kv, indices, topk_length)
    num_tokens, num_heads, _ = q.shape
    if out is None:
        out = torch.empty_like(q)
    max_logits = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    lse = torch.empty_like(max_logits)

    grid = (triton.cdiv(num_heads, heads_per_program), num_tokens)
    placeholder = indices  # any tensor: pointers of absent inputs are never read
    _sparse_mla_prefill_kernel[grid](
        q,
        kv,
        indices,
        topk_length if topk_length is not None else placeholder,
        attn_sink if attn_sink is not None else placeholder,
        out,
        max_logits,
        lse,
        num_heads,
        kv.shape[0],
        indices.shape[1],
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        HAS_LENGTHS=topk_length is not None,
        HAS_SINK=attn_sink is not None,
        HEADS_PER_PROGRAM=heads_per_program,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype(),
        NUM_STAGES=num_stages,
        num_warps=num_warps,
    )
    return out, max_logits, lse


def sparse_mla_prefill_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference in fp32: (out, max_logits, lse) as `sparse_mla_prefill`."""
    kv = kv_rows(kv).float()
    rows = as_token_major(indices, "indices").to(torch.int64)
    positions = torch.arange(rows.shape[1], device=rows.device)
    valid = (rows >= 0) & (rows < kv.shape[0])
    if topk_length is not None:
        valid &= positions.unsqueeze(0) < topk_length.to(torch.int64).unsqueeze(1)
    keys = kv[torch.where(valid, rows, 0)]  # [S_q, K, 512]
    scores = torch.einsum("thd,tkd->thk", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [S_q, H]
    max_logits = scores.max(dim=-1).values
    out = torch.einsum("thk,tkd->thd", torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0),
                       keys)
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink.float()).nan_to_num(0.0).unsqueeze(-1)
    return out, max_logits, lse.masked_fill(lse == float("-inf"), float("inf"))
