"""The fp8 codec's inline PTX, run in a CPU emulation of its instructions, against torch.

Under Triton's interpreter (CI) the codec takes its portable fp32 paths, so the PTX fast
paths would otherwise run only on a GPU (`test_fp8_e4m3.py` there). These tests execute
the PTX text itself through `ptx_emulation`, whose reading of the instructions those GPU
runs confirm; a change to the PTX that breaks it fails in CI.
"""

from __future__ import annotations

import numpy as np
import torch

from services.engine.backport.kernels.fp8_e4m3 import (
    _BF16_TO_E4M3_PTX,
    _E4M3_TO_BF16_PTX,
    _E4M3_TO_BF16_SCALED_PTX,
    MAX_SCALE_EXPONENT,
    dequantize_e4m3_bf16_reference,
    quantize_e4m3_bf16_reference,
)
from tests.kernels.ptx_emulation import PtxBlock
from tests.kernels.test_fp8_e4m3 import QUANTIZE_SCALE_EXPONENTS

EVERY_BF16 = np.arange(1 << 16, dtype=np.uint64)


def _pairs(lanes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """16-bit lanes, four a thread, as the thread's two 32-bit words (element 0 low)."""
    quads = lanes.reshape(-1, 4)
    return quads[:, 0] | quads[:, 1] << 16, quads[:, 2] | quads[:, 3] << 16


def _bytes_word(data: np.ndarray) -> np.ndarray:
    quads = data.astype(np.uint64).reshape(-1, 4)
    return quads[:, 0] | quads[:, 1] << 8 | quads[:, 2] << 16 | quads[:, 3] << 24


def _unpack_halves(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    words = np.stack([low, high], axis=1)
    return np.stack([words & 0xFFFF, words >> 16], axis=2).reshape(-1)


def test_bf16_quantize_ptx_matches_torch_emulated() -> None:
    exponents = np.array(QUANTIZE_SCALE_EXPONENTS)
    values = np.tile(EVERY_BF16, len(exponents))
    value_exponents = np.repeat(exponents, 1 << 16)
    multipliers = ((127 - value_exponents) << 7).astype(np.uint64)  # bf16 2**-e
    (packed,) = PtxBlock(_BF16_TO_E4M3_PTX.value).run(1, *_pairs(values), *_pairs(multipliers))
    got = ((packed[:, None] >> np.arange(0, 32, 8, dtype=np.uint64)) & 0xFF).reshape(-1)

    x = torch.from_numpy(values.astype(np.int32)).to(torch.int16).view(torch.bfloat16)
    want = quantize_e4m3_bf16_reference(x, torch.from_numpy(value_exponents)).numpy()
    assert int((got != want).sum()) == 0  # NaN signs included


def test_e4m3_to_bf16_ptx_matches_torch_emulated() -> None:
    every_byte = np.arange(256, dtype=np.uint64)
    not_nan = (every_byte & 0x7F) != 0x7F
    exponents = np.arange(-40, MAX_SCALE_EXPONENT + 1)
    data = np.tile(every_byte[not_nan], len(exponents))
    data_exponents = np.repeat(exponents, int(not_nan.sum()))
    multipliers = ((data_exponents + 247) << 7).astype(np.uint64)  # bf16 2**(120 + e)
    scaled = PtxBlock(_E4M3_TO_BF16_SCALED_PTX.value).run(
        2, _bytes_word(data), *_pairs(multipliers))
    got = _unpack_halves(*scaled)
    want = dequantize_e4m3_bf16_reference(
        torch.from_numpy(data.astype(np.uint8)), torch.from_numpy(data_exponents)
    ).view(torch.int16).numpy().astype(np.uint64) & 0xFFFF
    assert int((got != want).sum()) == 0

    data = np.tile(every_byte[not_nan], 2)  # 254 bytes: twice, for whole words
    unscaled = PtxBlock(_E4M3_TO_BF16_PTX.value).run(2, _bytes_word(data))
    want = dequantize_e4m3_bf16_reference(
        torch.from_numpy(data.astype(np.uint8)), torch.zeros(len(data), dtype=torch.int64)
    ).view(torch.int16).numpy().astype(np.uint64) & 0xFFFF
    assert int((_unpack_halves(*unscaled) != want).sum()) == 0
