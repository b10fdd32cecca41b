"""Attention KV compress + norm + rope + fp8_ds_mla insert against its torch reference."""

from __future__ import annotations

import pytest
import torch

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels import kv_compress_insert as compressor
from services.engine.backport.kernels.kv_compress_insert import (
    kv_compress_insert,
    kv_compress_insert_reference,
)
from tests.kernels.test_indexer_k_compress import cos_sin_cache, decode_step_batch

CACHE_BLOCK_SIZE = 4
NUM_CACHE_BLOCKS = 16


def compressor_inputs(compress_ratio: int, seq_len: int, seed: int) -> dict:
    """A sequence's state cache, block table and slots: every window-closing token gets a
    cache slot, one token's state slot is -1."""
    generator = torch.Generator().manual_seed(seed)
    overlap = compress_ratio == 4
    state_width = layout.HEAD_DIM * (1 + overlap)
    state_block_size, num_state_blocks = 8, -(-seq_len // 8) + 4
    state = torch.randn(num_state_blocks, state_block_size, 2 * state_width, generator=generator)
    block_table = torch.randperm(num_state_blocks, generator=generator)[: -(-seq_len // 8)]
    positions = torch.arange(seq_len)
    slot_mapping = torch.arange(seq_len)
    closes_window = (positions + 1) % compress_ratio == 0
    slot_mapping[int(closes_window.nonzero()[0])] = -1
    kv_slots = torch.full((seq_len,), -1, dtype=torch.int64)
    kv_slots[closes_window] = torch.randperm(CACHE_BLOCK_SIZE * NUM_CACHE_BLOCKS,
                                             generator=generator)[: int(closes_window.sum())]
    return dict(
        state_cache=state,
        token_to_req_indices=torch.zeros(seq_len, dtype=torch.int32),
        positions=positions,
        slot_mapping=slot_mapping,
        block_table=block_table.view(1, -1).to(torch.int32),
        cos_sin_cache=cos_sin_cache(),
        kv_slot_mapping=kv_slots,
        rms_norm_weight=(torch.rand(layout.HEAD_DIM, generator=generator) + 0.5).to(
            torch.bfloat16
        ),
        rms_norm_eps=1e-6,
        compress_ratio=compress_ratio,
        block_size=CACHE_BLOCK_SIZE,
    )


def compressed_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache's rows at `slots`, dequantized [N, 512] fp32."""
    return layout.read_rows_reference(cache.cpu(), slots, CACHE_BLOCK_SIZE)


@pytest.fixture(params=["one-token-a-program", "scanning"])
def batch_plan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test under both ways a program finds its tokens: one token a program, or a
    scan of several, finishing each closing one in turn (at ratio 128 the windows are
    merged over dim slices first either way)."""
    scan = 1 if request.param == "one-token-a-program" else 8
    monkeypatch.setattr(compressor, "tokens_a_program", lambda *_: scan)
    return request.param


def test_tokens_a_program() -> None:
    """A scan as long as the batch's tokens a request (a power of two): decode steps one
    token a program, a long prefill MAX_SCAN, a mixed batch between; ratio 4 always one."""
    assert compressor.tokens_a_program(64, 64, 128) == 1
    assert compressor.tokens_a_program(8192, 1, 128) == compressor.MAX_SCAN
    assert compressor.tokens_a_program(2048, 257, 128) == 4
    assert compressor.tokens_a_program(100, 1, 128) == 64
    assert compressor.tokens_a_program(8192, 1, 4) == 1
    # Never more programs than a grid's second axis takes.
    assert compressor.tokens_a_program(200_000, 200_000, 128) == 4


def compressed_by_kernel(args: dict, device: str) -> torch.Tensor:
    got = layout.allocate_cache(NUM_CACHE_BLOCKS, CACHE_BLOCK_SIZE, device)
    kv_compress_insert(
        kv_cache=got,
        **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()},
    )
    return got


@pytest.mark.parametrize("compress_ratio", [4, 128])
def test_kv_compress_insert(
    kernel_device: str, compress_ratio: int, batch_plan: str, record_max_error
) -> None:
    seq_len = 3 * compress_ratio + 5
    args = compressor_inputs(compress_ratio, seq_len, seed=compress_ratio)
    want = layout.allocate_cache(NUM_CACHE_BLOCKS, CACHE_BLOCK_SIZE, "cpu")
    kv_compress_insert_reference(kv_cache=want, **args)
    got = compressed_by_kernel(args, kernel_device)

    written = args["kv_slot_mapping"][(args["kv_slot_mapping"] >= 0) & (args["slot_mapping"] >= 0)]
    assert written.numel() >= 2
    got_rows, want_rows = compressed_rows(got, written), compressed_rows(want, written)
    relative = ((got_rows - want_rows).norm() / want_rows.norm()).item()
    # exp/rsqrt (and the online softmax at ratio 128) differ from torch's in the last fp32
    # bits; after the bf16 and fp8 roundings that moves a value by one step, rarely.
    record_max_error("_kv_compress_kernel", relative)
    assert relative < 1e-2
    # Nothing else in the cache was touched: the skipped token's slot stays zero.
    skipped = args["kv_slot_mapping"][args["slot_mapping"] < 0]
    assert (compressed_rows(got, skipped) == 0).all()
    differing = (got.cpu() != want).float().mean().item()
    assert differing < 0.01


@pytest.mark.parametrize("compress_ratio", [4, 128])
def test_kv_compress_insert_decode_step(
    kernel_device: str, compress_ratio: int, batch_plan: str
) -> None:
    """A decode step's batch (`decode_step_batch`): the requests' windows come from their
    own block tables, some tokens close a window and some do not, one request is shorter
    than a window."""
    args = compressor_inputs(compress_ratio, compress_ratio, seed=compress_ratio)
    args.update(decode_step_batch(compress_ratio, args["state_cache"].shape[-1],
                                  CACHE_BLOCK_SIZE * NUM_CACHE_BLOCKS, seed=40 + compress_ratio))
    positions, kv_slots = args["positions"], args["kv_slot_mapping"]
    want = layout.allocate_cache(NUM_CACHE_BLOCKS, CACHE_BLOCK_SIZE, "cpu")
    kv_compress_insert_reference(kv_cache=want, **args)
    got = compressed_by_kernel(args, kernel_device)

    closes = (positions + 1) % compress_ratio == 0
    assert int(closes.sum()) == 4
    got_rows = compressed_rows(got, kv_slots[closes])
    want_rows = compressed_rows(want, kv_slots[closes])
    assert ((got_rows - want_rows).norm() / want_rows.norm()).item() < 1e-2
    assert (compressed_rows(got, kv_slots[~closes]) == 0).all()
