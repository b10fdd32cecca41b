"""Resident blocks an SM from the target cards' limits, against figures worked out by hand
with the occupancy rules (1 KB of shared memory kept per block, registers granted a warp
in units of 256)."""

from __future__ import annotations

import pytest

from services.engine.backport.kernels.card_limits import resident_blocks


@pytest.mark.parametrize(
    ("arch", "threads", "shared", "registers", "blocks"),
    [
        # The CUDA sparse MLA decode: 43,552 B, 128 threads.
        ("sm80", 128, 43_552, 128, 3),  # 4 x 44,576 B is over the A100's 167,936 B
        ("sm86", 128, 43_552, 128, 2),
        ("sm89", 128, 43_552, 168, 2),
        ("sm80", 128, 43_552, 168, 3),  # 168 x 32 = 5,376 registers a warp: 12 warps
        ("sm80", 128, 20_000, 168, 3),  # registers bound it now
        ("sm80", 128, 20_000, 128, 4),
        ("sm80", 128, 20_000, 255, 2),  # 8,192 a warp once rounded to the 256-register unit
        # Thread and block limits.
        ("sm80", 1024, 0, None, 2),
        ("sm86", 1024, 0, None, 1),  # 1,536 threads an SM
        ("sm86", 32, 0, None, 16),
        ("sm89", 32, 0, None, 24),
        # Over the per-block limit: no block at all.
        ("sm86", 128, 101_377, None, 0),
        ("sm80", 128, 166_912, None, 1),
    ],
)
def test_resident_blocks(arch: str, threads: int, shared: int, registers: int | None,
                         blocks: int) -> None:
    assert resident_blocks(arch, threads, shared, registers) == blocks
