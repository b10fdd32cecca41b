"""Indexer K compress + norm + rope + fp8 insert against its torch reference."""

from __future__ import annotations

import pytest
import torch

from services.engine.backport.kernels import indexer_k_compress as compressor
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


CACHE_BLOCK_SIZE = 4
NUM_CACHE_BLOCKS = 16
PAGE_BYTES = -(-CACHE_BLOCK_SIZE * (HEAD_DIM + 4) // 576) * 576


def indexer_cache(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(zeroed page storage, its [blocks, block_size, 132] view as vLLM passes it)."""
    storage = torch.zeros(NUM_CACHE_BLOCKS, PAGE_BYTES, dtype=torch.uint8, device=device)
    view = storage.as_strided((NUM_CACHE_BLOCKS, CACHE_BLOCK_SIZE, HEAD_DIM + 4),
                              (PAGE_BYTES, HEAD_DIM + 4, 1))
    return storage, view


def indexer_inputs(compress_ratio: int, kernel_device: str) -> dict:
    """One sequence's compressor state and slots (one token's state slot is -1), on CPU;
    the interpreter gets fewer tokens at ratio 128."""
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
    slot_mapping = torch.arange(num_tokens)
    slot_mapping[1] = -1
    closes_window = (positions + 1) % compress_ratio == 0
    kv_slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    kv_slots[closes_window] = torch.randperm(NUM_CACHE_BLOCKS * CACHE_BLOCK_SIZE,
                                             generator=generator)[: int(closes_window.sum())]
    return dict(
        state_cache=state,
        token_to_req_indices=torch.zeros(num_tokens, dtype=torch.int32),
        positions=positions,
        slot_mapping=slot_mapping,
        block_table=block_table,
        cos_sin_cache=cos_sin_cache(),
        kv_slot_mapping=kv_slots,
        rms_norm_weight=(torch.rand(HEAD_DIM, generator=generator) + 0.5).to(torch.bfloat16),
        rms_norm_eps=1e-6,
        compress_ratio=compress_ratio,
    )


@pytest.fixture(params=["one-token-a-program", "scanning"])
def batch_plan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test under both ways a program finds its tokens: one token a program, or a
    scan of eight (two ratio-4 windows of a prefill; a decode step's tokens from several
    requests), finishing each closing one in turn."""
    scan = 1 if request.param == "one-token-a-program" else 8
    monkeypatch.setattr(compressor, "tokens_a_program", lambda *_: scan)
    return request.param


def test_tokens_a_program() -> None:
    """A prefill scans a window's tokens (two windows' at ratio 4), a decode step one
    token a program, a batch of short chunks as many tokens as a request has."""
    assert compressor.tokens_a_program(131072, 1, 4) == 8
    assert compressor.tokens_a_program(64, 64, 4) == 1
    assert compressor.tokens_a_program(6, 1, 4) == 4
    assert compressor.tokens_a_program(8192, 1, 128) == 128
    assert compressor.tokens_a_program(2048, 700, 128) == 2


def inserted_by_kernel(args: dict, device: str) -> torch.Tensor:
    """The kernel's cache pages (on the CPU) after inserting `args`' rows."""
    storage, view = indexer_cache(device)
    indexer_k_compress_insert(
        kv_cache=view,
        **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()},
    )
    return storage.cpu()


@pytest.mark.parametrize("compress_ratio", [4, 128])
def test_indexer_k_compress_insert(
    kernel_device: str, compress_ratio: int, batch_plan: str, record_max_error
) -> None:
    args = indexer_inputs(compress_ratio, kernel_device)
    kv_slots, slot_mapping = args["kv_slot_mapping"], args["slot_mapping"]
    _, want = indexer_cache("cpu")
    indexer_k_compress_insert_reference(kv_cache=want, **args)
    got_storage = inserted_by_kernel(args, kernel_device)
    got = got_storage.as_strided(want.shape, want.stride())

    written = kv_slots[(kv_slots >= 0) & (slot_mapping >= 0)]
    assert written.numel() > 0
    got_rows = dequantize_indexer_rows(got, CACHE_BLOCK_SIZE, written)
    want_rows = dequantize_indexer_rows(want, CACHE_BLOCK_SIZE, written)
    relative = ((got_rows - want_rows).norm() / want_rows.norm()).item()
    # exp/rsqrt differ from torch's in the last fp32 bits; after bf16 rounding and fp8
    # quantization that can move a value by one fp8 step, rarely.
    record_max_error("_indexer_k_compress_kernel", relative)
    assert relative < 1e-2
    untouched = torch.ones(NUM_CACHE_BLOCKS * PAGE_BYTES, dtype=torch.bool)
    for slot in written.tolist():
        page = (slot // CACHE_BLOCK_SIZE) * PAGE_BYTES
        in_page = slot % CACHE_BLOCK_SIZE
        untouched[page + in_page * HEAD_DIM : page + (in_page + 1) * HEAD_DIM] = False
        scale_at = page + CACHE_BLOCK_SIZE * HEAD_DIM + in_page * 4
        untouched[scale_at : scale_at + 4] = False
    assert (got_storage.view(-1)[untouched] == 0).all()


def decode_step_batch(
    compress_ratio: int, state_row_values: int, num_cache_slots: int, seed: int
) -> dict:
    """One token for each of six requests, as a decode step has them, each request's state
    rows in blocks of its own: tokens 0-2 close a window, token 3 its sequence's first,
    tokens 4 and 5 none. The compressors' arguments that change, on CPU."""
    generator = torch.Generator().manual_seed(seed)
    window = (1 + (compress_ratio == 4)) * compress_ratio
    num_requests, state_block_size = 6, 8
    blocks_per_request = -(-(window + 2 * compress_ratio) // state_block_size)
    positions = torch.randint(window, window + compress_ratio - 1, (num_requests,),
                              generator=generator)
    positions[:3] = window + compress_ratio - 1
    positions[3] = compress_ratio - 1
    state = torch.randn(num_requests * blocks_per_request, state_block_size, state_row_values,
                        generator=generator)
    return dict(
        state_cache=state,
        token_to_req_indices=torch.randperm(num_requests, generator=generator).to(torch.int32),
        positions=positions,
        slot_mapping=positions.clone(),
        block_table=torch.randperm(state.shape[0], generator=generator)
        .view(num_requests, blocks_per_request)
        .to(torch.int32),
        kv_slot_mapping=torch.randperm(num_cache_slots, generator=generator)[:num_requests],
    )


@pytest.mark.parametrize("compress_ratio", [4, 128])
def test_indexer_k_compress_insert_decode_step(
    kernel_device: str, compress_ratio: int, batch_plan: str
) -> None:
    """A decode step's batch (`decode_step_batch`): each window from its request's block
    table; a scanning program finishes several."""
    args = indexer_inputs(compress_ratio, kernel_device)
    args.update(decode_step_batch(compress_ratio, args["state_cache"].shape[-1],
                                  NUM_CACHE_BLOCKS * CACHE_BLOCK_SIZE, seed=50 + compress_ratio))
    positions, kv_slots = args["positions"], args["kv_slot_mapping"]
    _, want = indexer_cache("cpu")
    indexer_k_compress_insert_reference(kv_cache=want, **args)
    got = inserted_by_kernel(args, kernel_device).as_strided(want.shape, want.stride())

    closes = (positions + 1) % compress_ratio == 0
    assert int(closes.sum()) == 4
    got_rows = dequantize_indexer_rows(got, CACHE_BLOCK_SIZE, kv_slots[closes])
    want_rows = dequantize_indexer_rows(want, CACHE_BLOCK_SIZE, kv_slots[closes])
    assert ((got_rows - want_rows).norm() / want_rows.norm()).item() < 1e-2
    assert (dequantize_indexer_rows(got, CACHE_BLOCK_SIZE, kv_slots[~closes]) == 0).all()
