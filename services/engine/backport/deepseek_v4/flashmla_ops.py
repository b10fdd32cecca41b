"""FlashMLA's and DeepSeek-V4's op signatures, as vLLM's CUDA path calls them, over the
backport's kernels.

vLLM's `DeepseekV4FlashMLAAttention` (`vllm/models/deepseek_v4/nvidia/flashmla.py`) calls
FlashMLA's sparse fp8 decode and sparse prefill, and DeepSeek-V4's K gather; its indexer
calls `fused_indexer_q_rope_quant`. FlashMLA runs on sm90/sm100 only and the upstream
Triton ops use fp8 instructions that sm80/86 lack. The prefill and the K gather need no
adapter (`sparse_mla_prefill`, `k_cache_gather` take the same arguments); the decode and
the indexer's Q quant do.
"""

from __future__ import annotations

import torch

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels import indexer_q_quant
from services.engine.backport.kernels.sparse_mla_decode import sparse_mla_decode


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: object = None,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse fp8 decode: (out shaped as q, lse [T, H, 1], natural log, +inf
    for a token with no valid key, as FlashMLA gives).

    Only the sparse fp8 form DeepSeek-V4 uses: `block_table` and `cache_seqlens` are unused
    there, and FlashMLA's tile-scheduler plan is replaced by the decode's own split rule.
    """
    if indices is None or not is_fp8_kvcache:
        raise NotImplementedError("only FlashMLA's sparse fp8 decode is backported "
                                  "(indices and is_fp8_kvcache=True)")
    if causal:
        raise ValueError("causal must be False with sparse indices")
    if head_dim_v != layout.HEAD_DIM:
        raise ValueError(f"head_dim_v must be {layout.HEAD_DIM}, got {head_dim_v}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    decoded, lse = sparse_mla_decode(
        q, k_cache, indices, softmax_scale, topk_length, attn_sink, extra_k_cache,
        extra_indices_in_kvcache, extra_topk_length, out=out)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return (out if out is not None else decoded.view(q.shape)), lse.unsqueeze(-1)


def fused_indexer_q_rope_quant(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    use_fp4: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's Q RoPE + fp8 quant; the MXFP4 form (`use_fp4`) is Blackwell's."""
    if use_fp4:
        raise NotImplementedError("the MXFP4 indexer cache is not backported")
    return indexer_q_quant.fused_indexer_q_rope_quant(
        positions, index_q, index_q_cos_sin_cache, index_weights,
        index_weights_softmax_scale, index_weights_head_scale)
