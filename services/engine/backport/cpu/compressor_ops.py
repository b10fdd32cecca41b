"""Torch versions of DeepSeek-V4's KV compressor kernels (vLLM `compressor.cpp` contracts).

The compressor keeps, per token, its projected KV and gate score (plus the
learned position bias) in a paged fp32 state cache; every `compress_ratio`-th
token pools its window with a per-channel softmax over the scores, normalizes,
rotates and stores one compressed record.
"""

from __future__ import annotations

import torch

from services.engine.backport.cpu import fp8_ds_mla as layout
from services.engine.backport.cpu.rope import rotate_gptj


def save_partial_states(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """state_cache[slot] = [kv | score + ape[position % ratio]] for every slot >= 0."""
    is_stored = slot_mapping >= 0
    slots = slot_mapping[is_stored]
    if slots.numel() == 0:
        return
    block_size = state_cache.shape[1]
    ratio = ape.shape[0]
    biased = score[is_stored] + ape[positions[is_stored] % ratio]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    state_cache[blocks, slots % block_size] = torch.cat([kv[is_stored], biased], dim=-1)


def _pooled_normed(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    compress_ratio: int,
    head_dim: int,
) -> torch.Tensor:
    """Softmax-pool each row's window over the state cache, then weighted RMSNorm."""
    block_size = state_cache.shape[1]
    state_width = state_cache.shape[2] // 2
    window = gather_slots.shape[1]
    valid = gather_slots >= 0
    slots = gather_slots.clamp(min=0)
    rows = state_cache[torch.div(slots, block_size, rounding_mode="floor"), slots % block_size]
    # Older half of an overlapping window reads the first head slice, newer half the second.
    offsets = torch.where(torch.arange(window) >= compress_ratio, head_dim, 0)
    cols = offsets.unsqueeze(-1) + torch.arange(head_dim)
    kv = torch.gather(rows, 2, cols.expand(rows.shape[0], -1, -1))
    score = torch.gather(rows, 2, (cols + state_width).expand(rows.shape[0], -1, -1))
    score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    pooled = (torch.softmax(score, dim=1) * kv.masked_fill(~valid.unsqueeze(-1), 0.0)).sum(dim=1)
    inv_rms = torch.rsqrt(pooled.square().mean(dim=-1, keepdim=True) + rms_norm_eps)
    return pooled * inv_rms * rms_norm_weight


def _emitting_rows(
    positions: torch.Tensor, kv_slot_mapping: torch.Tensor, compress_ratio: int
) -> torch.Tensor:
    return ((positions + 1) % compress_ratio == 0) & (kv_slot_mapping >= 0)


def compress_norm_rope_store(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """Head-512 compressor: store fp8_ds_mla records (NoPE bf16-rounded before quant)."""
    emits = _emitting_rows(positions, kv_slot_mapping, compress_ratio)
    if not bool(emits.any()):
        return
    normed = _pooled_normed(
        state_cache, gather_slots[emits], rms_norm_weight, rms_norm_eps, compress_ratio,
        layout.HEAD_DIM,
    )
    compressed_pos = torch.div(positions[emits], compress_ratio, rounding_mode="floor")
    cos_sin = cos_sin_cache[compressed_pos * compress_ratio]
    rope = rotate_gptj(normed[:, layout.NOPE_DIM :], cos_sin)
    layout.write_ds_mla_records(
        kv_cache_2d,
        kv_slot_mapping[emits],
        kv_cache_block_size,
        layout.bf16_round(normed[:, : layout.NOPE_DIM]),
        rope,
    )


def compress_norm_rope_store_indexer(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """Head-128 indexer compressor: the whole rotated key is bf16-rounded, one fp32 scale."""
    emits = _emitting_rows(positions, kv_slot_mapping, compress_ratio)
    if not bool(emits.any()):
        return
    head_dim = layout.INDEXER_HEAD_DIM
    normed = _pooled_normed(
        state_cache, gather_slots[emits], rms_norm_weight, rms_norm_eps, compress_ratio, head_dim
    )
    rope_dim = cos_sin_cache.shape[-1]
    compressed_pos = torch.div(positions[emits], compress_ratio, rounding_mode="floor")
    cos_sin = cos_sin_cache[compressed_pos * compress_ratio]
    normed[:, head_dim - rope_dim :] = rotate_gptj(normed[:, head_dim - rope_dim :], cos_sin)
    layout.write_indexer_records(
        kv_cache_2d, kv_slot_mapping[emits], kv_cache_block_size, layout.bf16_round(normed)
    )
