"""Torch versions of the DeepSeek-V4 sparse-MLA attention kernels the AVX2 build lacks.

vLLM's CPU DeepSeek-V4 path calls these `_C` ops; only the AVX512-BF16 `_C`
library ships them. Semantics follow the op contracts in vLLM's
`csrc/cpu/sgl-kernels` (store_cache.cpp, flash_mla.cpp, bmm.cpp).
"""

from __future__ import annotations

import torch

from services.engine.backport.cpu import fp8_ds_mla as layout
from services.engine.backport.cpu.rope import rotate_gptj

# Query tokens attended per step: bounds the scores working set
# (tokens x heads x keys in the chunk's union, fp32) on long prefills.
_TOKENS_PER_CHUNK = 128


def fused_qnorm_rope_kv_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    swa_kv_cache_2d: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_head_padded: int,
    eps: float,
    cache_block_size: int,
) -> torch.Tensor:
    """Q: per-head weight-free RMSNorm + RoPE, padded heads zeroed.
    KV: RoPE, bf16 round trip, UE8M0 fp8 insert into the sliding-window cache."""
    num_tokens, num_heads, _ = q.shape
    cos_sin = cos_sin_cache[positions]
    qf = q.to(torch.float32)
    qf = qf * torch.rsqrt(qf.square().mean(dim=-1, keepdim=True) + eps)
    qf[..., layout.NOPE_DIM :] = rotate_gptj(qf[..., layout.NOPE_DIM :], cos_sin.unsqueeze(1))
    q_out = q.new_zeros((num_tokens, q_head_padded, q.shape[-1]))
    q_out[:, :num_heads] = qf.to(q.dtype)

    num_insert = slot_mapping.shape[0]
    is_stored = slot_mapping >= 0
    kvf = kv[:num_insert].to(torch.float32)[is_stored]
    rope = rotate_gptj(kvf[:, layout.NOPE_DIM :], cos_sin[:num_insert][is_stored])
    layout.write_ds_mla_records(
        swa_kv_cache_2d,
        slot_mapping[is_stored],
        cache_block_size,
        layout.bf16_round(kvf[:, : layout.NOPE_DIM]),
        layout.bf16_round(rope),
    )
    return q_out


def flash_mla_with_kvcache(
    out: torch.Tensor,
    q: torch.Tensor,
    window_cache_2d: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache_2d: torch.Tensor,
    compressed_slots: torch.Tensor,
    compressed_block_size: int,
    attn_sink: torch.Tensor,
    scale: float,
) -> None:
    """Sparse MQA over the window and compressed slot sets, with an attention sink.

    Keys double as values (MLA); invalid slots (-1 or past the cache) are
    masked; a row with no valid key outputs zeros.
    """
    window_keys, window_index = _dequantized_keys(window_cache_2d, window_slots, window_block_size)
    compressed_keys, compressed_index = _dequantized_keys(
        compressed_cache_2d, compressed_slots, compressed_block_size
    )
    keys = torch.cat([window_keys, compressed_keys], dim=0)
    shifted = torch.where(compressed_index >= 0, compressed_index + window_keys.shape[0], -1)
    index = torch.cat([window_index, shifted], dim=1)
    qf = q.to(torch.float32)
    for start in range(0, q.shape[0], _TOKENS_PER_CHUNK):
        stop = min(start + _TOKENS_PER_CHUNK, q.shape[0])
        out[start:stop] = _attend(qf[start:stop], keys, index[start:stop], attn_sink, scale).to(
            out.dtype
        )


def _dequantized_keys(
    cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize each distinct valid slot once; return (keys, per-position row or -1)."""
    total = cache_2d.shape[0] * block_size
    valid = (slots >= 0) & (slots < total)
    if not bool(valid.any()):
        return torch.zeros((1, layout.HEAD_DIM)), torch.full_like(slots, -1)
    unique_slots, inverse = torch.unique(torch.where(valid, slots, 0), return_inverse=True)
    keys = layout.read_ds_mla_records(cache_2d, unique_slots, block_size)
    return keys, torch.where(valid, inverse, -1)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    index: torch.Tensor,
    attn_sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of a chunk of tokens over their own key subsets.

    Consecutive tokens share most keys (overlapping windows, common top-k), so
    the chunk scores the union of its keys with two dense GEMMs and masks per
    token, instead of gathering a private key copy per token.
    """
    num_tokens, num_heads, head_dim = q.shape
    valid = index >= 0
    # Invalid entries stay -1: a distinct union member that no token is allowed.
    union, local = _union_in_logical_order(index)
    chunk_keys = keys[union.clamp(min=0)]  # [U, 512]
    allowed = torch.zeros((num_tokens, union.shape[0]), dtype=torch.bool)
    token = torch.arange(num_tokens).unsqueeze(-1).expand_as(local)
    allowed[token[valid], local[valid]] = True
    scores = (q.reshape(-1, head_dim) @ chunk_keys.T).view(num_tokens, num_heads, -1) * scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    has_key = torch.isfinite(row_max)
    weights = torch.exp(scores - torch.where(has_key, row_max, 0.0))
    denom = weights.sum(dim=-1, keepdim=True)
    lse = torch.where(has_key, row_max + torch.log(denom), float("inf"))
    # The sink is a zero-valued virtual key: it only shrinks the attended mass.
    sink_share = 1.0 / (1.0 + torch.exp(attn_sink.view(1, -1, 1) - lse))
    out = (weights.view(-1, union.shape[0]) @ chunk_keys).view(num_tokens, num_heads, head_dim)
    out = out / denom.clamp(min=1e-30)
    return torch.where(has_key, out * sink_share, 0.0)


def _union_in_logical_order(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values of `index` ordered by first appearance, and each entry's rank.

    Slot lists arrive in logical (position or score) order; keeping that order,
    not the physical slot order, makes the GEMM reduction order, and so the
    bits of the result, independent of where the cache blocks were allocated.
    """
    distinct, inverse = torch.unique(index, return_inverse=True)
    flat = inverse.flatten()
    first_seen = torch.full((distinct.shape[0],), flat.numel(), dtype=torch.int64)
    first_seen.scatter_reduce_(0, flat, torch.arange(flat.numel()), reduce="amin")
    order = torch.argsort(first_seen)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0])
    return distinct[order], rank[inverse]


def inverse_gptj_rope_o_proj(
    o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """Undo the query's RoPE on the last `rope_dim` dims of the attention output (fp32 out)."""
    out = o.to(torch.float32)
    nope = o.shape[-1] - rope_dim
    out[..., nope:] = rotate_gptj(
        out[..., nope:], cos_sin_cache[positions].unsqueeze(1), inverse=True
    )
    return out


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """The packed form `bmm_cpu` reads here is the plain contiguous [B, N, K] weight."""
    return weight.clone(memory_format=torch.contiguous_format)


def bmm_cpu(
    out: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    is_vnni: bool,
    scale: torch.Tensor | None,
) -> None:
    """out[b] = mat1[b] @ mat2[b]^T, mat2 as returned by `convert_weight_packed`."""
    product = torch.bmm(mat1.to(torch.float32), mat2.to(torch.float32).transpose(1, 2))
    if scale is not None:
        product = product * scale.to(torch.float32)
    out.copy_(product.to(out.dtype))
