"""The ratio-128 window merge against `merge_window_reference`, window by window."""

from __future__ import annotations

import pytest
import torch

from services.engine.backport.kernels.compressor_window import merge_window_reference
from services.engine.backport.kernels.kv_window_merge import merge_windows
from tests.kernels.test_kv_compress_insert import compressor_inputs

RATIO = 128


@pytest.mark.parametrize("scan", [1, 8])
def test_merge_windows(kernel_device: str, scan: int, record_max_error) -> None:
    """Each closing token's merged row equals the reference's in fp32, at one token a
    program and with a scan that meets several closing tokens."""
    args = compressor_inputs(RATIO, 3 * RATIO + 5, seed=7)
    names = ("state_cache", "token_to_req_indices", "positions", "slot_mapping",
             "block_table", "kv_slot_mapping")
    merged = merge_windows(*(args[name].to(kernel_device) for name in names), scan=scan)

    positions, table = args["positions"], args["block_table"]
    closing = ((positions + 1) % RATIO == 0) & (args["slot_mapping"] >= 0)
    closing &= args["kv_slot_mapping"] >= 0
    tokens = closing.nonzero().flatten()
    assert tokens.numel() >= 2
    # Only the closing tokens' rows are written (the others are never read).
    got_rows = merged[tokens.to(kernel_device)].cpu()
    for token, got in zip(tokens.tolist(), got_rows):
        request = int(args["token_to_req_indices"][token])
        want = merge_window_reference(args["state_cache"], table[request],
                                      int(positions[token]), RATIO, got.shape[0])
        relative = ((got - want).norm() / want.norm()).item()
        record_max_error("_merge_slices_kernel", relative)
        # The online softmax's exp and division differ from torch's in the last bits.
        assert relative < 1e-5
