"""Indexer K compress + norm + rope + fp8 insert against its torch reference."""

from __future__ import annotations

import pytest
import torch

from services.engine.backport.kernels.indexer_k_compress import (
    indexer_k_compress_insert,
    indexer_k_compress_insert_reference,
)

HEAD_DIM = 128
ROPE_DIM = 64
MAX_POSITION = 1024


def cos_sin_cache() -> torch.Tensor:
    inverse_frequency = 1.0 / (10000 ** (torch.arange(0, ROPE_DIM, 2).float() / ROPE_DIM))
    angles = torch.arange(MAX_POSITION).float().unsqueeze(1) * inverse_frequency
    return torch.cat([angles.cos(), angles.sin()], dim=1)


def dequantize_indexer_rows(
    cache: torch.Tensor, block_size: int, slots: torch.Tensor
) -> torch.Tensor:
    flat = cache.as_strided((cache.shape[0] * cache.stride(0),), (1,))
    rows = []
    for slot in slots.tolist():
        page = (slot // block_size) * cache.stride(0)
        in_page = slot % block_size
        values = (
            flat[page + in_page * HEAD_DIM : page + (in_page + 1) * HEAD_DIM]
            .view(torch.float8_e4m3fn)
            .float()
        )
        scale_at = page + block_size * HEAD_DIM + in_page * 4
        rows.append(values * flat[scale_at : scale_at + 4].view(torch.float32))
    return torch.stack(rows)


@pytest.mark.parametrize("compress_ratio", [4, 128])
def test_indexer_k_compress_insert(
    kernel_device: str, compress_ratio: int, record_max_error
) -> None:
    generator = torch.Generator().manual_seed(compress_ratio)
    overlap = compress_ratio == 4
    state_width = HEAD_DIM * (1 + overlap)
    state_block_size, num_state_blocks = (4, 64) if overlap else (8, 64)
    seq_len = 40 if overlap else 2 * compress_ratio + 3
    state = torch.randn(num_state_blocks, state_block_size, 2 * state_width, generator=generator)
    max_blocks = -(-seq_len // state_block_size)
    block_table = (
        torch.randperm(num_state_blocks, generator=generator)[:max_blocks]
        .view(1, -1)
        .to(torch.int32)
    )
    positions = torch.arange(seq_len)
    if kernel_device == "cpu" and not overlap:
        positions = positions[compress_ratio - 2 :]  # the interpreter is slow: fewer tokens
    num_tokens = positions.shape[0]
    token_to_req = torch.zeros(num_tokens, dtype=torch.int32)
    slot_mapping = torch.arange(num_tokens)
    slot_mapping[1] = -1
    closes_window = (positions + 1) % compress_ratio == 0
    cache_block_size = 4
    kv_slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    kv_slots[closes_window] = torch.randperm(64, generator=generator)[: int(closes_window.sum())]
    page_bytes = -(-cache_block_size * (HEAD_DIM + 4) // 576) * 576
    cache = torch.zeros(16, page_bytes, dtype=torch.uint8).as_strided(
        (16, cache_block_size, HEAD_DIM + 4), (page_bytes, HEAD_DIM + 4, 1)
    )
    norm_weight = (torch.rand(HEAD_DIM, generator=generator) + 0.5).to(torch.bfloat16)
    cos_sin = cos_sin_cache()
    args = dict(
        state_cache=state,
        token_to_req_indices=token_to_req,
        positions=positions,
        slot_mapping=slot_mapping,
        block_table=block_table,
        cos_sin_cache=cos_sin,
        kv_slot_mapping=kv_slots,
        rms_norm_weight=norm_weight,
        rms_norm_eps=1e-6,
        compress_ratio=compress_ratio,
    )
    want_storage = torch.zeros(16, page_bytes, dtype=torch.uint8)
    want = want_storage.as_strided(cache.shape, cache.stride())
    indexer_k_compress_insert_reference(kv_cache=want, **args)
    got_storage = torch.zeros(16, page_bytes, dtype=torch.uint8, device=kernel_device)
    got = got_storage.as_strided(cache.shape, cache.stride())
    device_args = {
        k: v.to(kernel_device) if isinstance(v, torch.Tensor) else v for k, v in args.items()
    }
    indexer_k_compress_insert(kv_cache=got, **device_args)

    written = kv_slots[(kv_slots >= 0) & (slot_mapping >= 0)]
    assert written.numel() > 0
    got_rows = dequantize_indexer_rows(
        got_storage.cpu().as_strided(cache.shape, cache.stride()), cache_block_size, written
    )
    want_rows = dequantize_indexer_rows(want, cache_block_size, written)
    relative = ((got_rows - want_rows).norm() / want_rows.norm()).item()
    # exp/rsqrt differ from torch's in the last fp32 bits; after bf16 rounding and fp8
    # quantization that can move a value by one fp8 step, rarely.
    record_max_error("_indexer_k_compress_kernel", relative)
    assert relative < 1e-2
    untouched = torch.ones(16 * page_bytes, dtype=torch.bool)
    for slot in written.tolist():
        page = (slot // cache_block_size) * page_bytes
        in_page = slot % cache_block_size
        untouched[page + in_page * HEAD_DIM : page + (in_page + 1) * HEAD_DIM] = False
        untouched[
            page + cache_block_size * HEAD_DIM + in_page * 4 : page
            + cache_block_size * HEAD_DIM
            + in_page * 4
            + 4
        ] = False
    assert (got_storage.cpu().view(-1)[untouched] == 0).all()
