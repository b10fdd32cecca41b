"""The software fp8 e4m3 codec is bit-exact against torch's float8_e4m3fn."""

from __future__ import annotations

import pytest
import torch

from services.engine.backport.kernels.fp8_e4m3 import (
    MAX_SCALE_EXPONENT,
    decode_e4m3,
    decode_e4m3_bf16,
    decode_e4m3_reference,
    dequantize_e4m3_bf16,
    dequantize_e4m3_bf16_reference,
    encode_e4m3,
    encode_e4m3_reference,
    quantize_e4m3_bf16,
    quantize_e4m3_bf16_reference,
)

E4M3_MAX = 448.0


def _mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((got.cpu() != want.cpu()).sum())


def test_encode_matches_torch_on_every_bf16_value(kernel_device: str, record_max_error) -> None:
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = every_bf16.float().to(kernel_device)
    mismatches = _mismatches(encode_e4m3(values), encode_e4m3_reference(values))
    record_max_error("_encode_kernel", float(mismatches))
    assert mismatches == 0


def test_encode_matches_torch_on_random_fp32(kernel_device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    count = 1 << 16
    magnitudes = torch.exp2(torch.randint(-24, 12, (count,), generator=generator).float())
    values = (torch.randn(count, generator=generator) * magnitudes).to(kernel_device)
    assert _mismatches(encode_e4m3(values), encode_e4m3_reference(values)) == 0


def _fp32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_encode_edges(kernel_device: str) -> None:
    # Rounding ties, the subnormal/normal boundary, the +-448 boundary and beyond.
    subnormal_step = 2.0**-9
    ties = [subnormal_step * (m + 0.5) for m in range(8)] + [
        2.0**-10,
        2.0**-6,
        2.0**-6 * (1 - 2**-5),
    ]
    boundary = [447.9, 448.0, 448.0001, 463.9, 464.0, 464.1, 479.9, 480.0, 1e6, 3.0e38]
    edges = torch.tensor(ties + boundary + [0.0, 1.0, 1.0625, 1.1875, 240.0, 256.0])
    edges = torch.cat([edges, -edges])
    nearly_tiny = _fp32_from_bits(
        [0x3A800001, 0x3A7FFFFF, 0x00000001, 0x007FFFFF, 0x3C7FFFFF, 0x3C800001]
    )
    values = torch.cat([edges, nearly_tiny, -nearly_tiny]).to(kernel_device)
    assert _mismatches(encode_e4m3(values), encode_e4m3_reference(values)) == 0


def test_encode_saturates_infinities_and_keeps_nan(kernel_device: str) -> None:
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan"), 1e30, -1e30])
    got = encode_e4m3(special.to(kernel_device)).cpu().tolist()
    assert got[:2] == [0x7E, 0xFE]  # +-448
    assert got[2] & 0x7F == 0x7F and got[3] & 0x7F == 0x7F  # NaN stays NaN
    assert got[4:] == [0x7E, 0xFE]


def test_decode_is_exact_for_every_byte(kernel_device: str, record_max_error) -> None:
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(kernel_device)
    exact = decode_e4m3(every_byte).cpu()
    want = decode_e4m3_reference(every_byte.cpu())
    is_nan = torch.isnan(want)
    assert torch.equal(torch.isnan(exact), is_nan)
    assert torch.equal(exact[~is_nan], want[~is_nan])
    assert torch.equal(torch.signbit(exact[~is_nan]), torch.signbit(want[~is_nan]))
    record_max_error("_decode_kernel", float((exact[~is_nan] != want[~is_nan]).sum()))


@pytest.mark.parametrize("value", [E4M3_MAX, -E4M3_MAX, 2.0**-9, -(2.0**-9), 2.0**-6])
def test_round_trip_of_representable_values(kernel_device: str, value: float) -> None:
    x = torch.tensor([value], device=kernel_device)
    assert decode_e4m3(encode_e4m3(x)).item() == value


def test_bf16_decode_is_exact(kernel_device: str, record_max_error) -> None:
    # The dot operands' decode: every non-NaN byte, as bf16 (which holds every e4m3 value).
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    data = every_byte[(every_byte & 0x7F) != 0x7F]
    got = decode_e4m3_bf16(data.to(kernel_device)).cpu()
    want = decode_e4m3_reference(data).to(torch.bfloat16)
    mismatches = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    record_max_error("_to_bf16_kernel", float(mismatches))
    assert mismatches == 0


def test_scaled_bf16_dequantize_is_exact(kernel_device: str, record_max_error) -> None:
    # Every non-NaN byte under every UE8M0 exponent a cached row can carry (upstream floors
    # a tile's amax at 1e-4: exponents from -22 up; 7 means a tile amax of 57,344).
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    not_nan = (every_byte & 0x7F) != 0x7F
    exponents = torch.tensor(list(range(-40, MAX_SCALE_EXPONENT + 1)))
    data = every_byte[not_nan].repeat(len(exponents))
    data_exponents = exponents.repeat_interleave(int(not_nan.sum()))
    got = dequantize_e4m3_bf16(data.to(kernel_device), data_exponents.to(kernel_device)).cpu()
    want = dequantize_e4m3_bf16_reference(data, data_exponents)
    mismatches = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    record_max_error("_dequantize_kernel", float(mismatches))
    assert mismatches == 0


# Scale exponents the bf16 quantizer is checked under: from upstream's smallest (amax
# floored at 1e-10) through the ones that saturate most values or round them to zero.
QUANTIZE_SCALE_EXPONENTS = (-40, -33, -21, -9, -1, 0, 1, 5, 8, 17, 60, 120, 126)


def test_bf16_quantize_matches_torch_on_every_bf16_value(kernel_device: str,
                                                        record_max_error) -> None:
    # Every bf16 pattern (NaN, infinities and subnormals included) over
    # QUANTIZE_SCALE_EXPONENTS, against the reference (torch's encode of x * 2**-e in fp32).
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    exponents = torch.tensor(QUANTIZE_SCALE_EXPONENTS)
    values = every_bf16.repeat(len(exponents))
    value_exponents = exponents.repeat_interleave(1 << 16)
    got = quantize_e4m3_bf16(values.to(kernel_device), value_exponents.to(kernel_device))
    want = quantize_e4m3_bf16_reference(values, value_exponents)
    # sm89's conversion (the "hardware" path) drops a NaN's sign: NaN bytes match in 0x7F.
    is_nan = values.isnan()
    got = got.cpu()
    got[is_nan] &= 0x7F
    want[is_nan] &= 0x7F
    mismatches = _mismatches(got, want)
    record_max_error("_quantize_bf16_kernel", float(mismatches))
    assert mismatches == 0
