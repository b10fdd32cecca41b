"""fp8 e4m3 (OCP `float8_e4m3fn`) encode/decode as Triton device functions over uint8.

Triton emits `tl.float8e4nv` only on sm89+, so on sm80/86 fp8 data must be read and
written as bytes and converted in software. These helpers use integer bit tricks and,
for the encoder's subnormals, one fp32 multiply-add whose rounding does the work, so
they lower to plain ALU instructions on every architecture.

Format: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits. Largest finite value
448 (0x7E), NaN is 0x7F/0xFF, there is no infinity. Subnormals are m * 2**-9, m in 1..7.

Encoding rules (`e4m3_encode`), the same as the hardware `cvt.rn.satfinite.e4m3x2.f32`,
which `e4m3_encode(x, HARDWARE=True)` uses where the arch has it (sm89+):
- finite values round to nearest, ties to even;
- |x| > 448 and +-inf saturate to +-448 (upstream clamps to +-448 before casting too);
- NaN encodes as 0x7F with the input's sign bit (0x7F or 0xFF).
torch's own conversion agrees bit for bit on finite inputs in [-448, 448]; for larger
inputs, infinities and NaN torch's behaviour has varied between releases (NaN or
saturation), so callers that need fp8 bytes from torch clamp first, as upstream does.

Decoding (`e4m3_decode`) is exact: every byte maps to the fp32 value it denotes, NaN
bytes to NaN, 0x80 to -0.0. `e4m3_dequantize_bf16` is the fast path for attention:
bytes times a power-of-two (UE8M0) scale straight to bf16 in 2 instructions a value
with inline PTX (prmt/shl/and, then a bf16x2 fma), sm80-safe, exact for every non-NaN
byte; NaN bytes come out finite there, which is harmless for caches we wrote.
`e4m3_to_bf16` is the same without a scale, for dot operands (see why there).

Quantizers encode with `e4m3_quantize_bf16`: their values are bf16, which sm80/86 encode
two a register with bf16x2 and integer PTX (under half the fp32 encode's instructions);
`fp8_encoder(device)` picks that path, sm89's hardware one or the interpreter's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
BLOCK_ELEMENTS = 1024  # elements per program in the element-wise test launchers


# fp32 -> e4m3 in hardware (sm89+), four values a call, each rounded straight from fp32.
# Not Triton's own `.to(tl.float8e4nv)`: Triton 3.6 lowers it through cvt.rz.f16.f32, a
# rounding toward zero before the fp8 one, and on 4 Mi random fp32 values it gave 10,248
# bytes that differ from round-to-nearest-even (H200, sm89 mode); this gave none.
_F32_TO_E4M3_PTX = tl.constexpr("""
{
.reg .b16 low, high;
cvt.rn.satfinite.e4m3x2.f32 low, $2, $1;
cvt.rn.satfinite.e4m3x2.f32 high, $4, $3;
mov.b32 $0, {low, high};
}
""")


@triton.jit
def e4m3_encode(x, HARDWARE: tl.constexpr = False):
    """fp32 tensor -> uint8 e4m3 bytes (round to nearest even, saturate to +-448).

    HARDWARE (sm89+ only, see `hardware_fp8_encode`): the card's own conversion, four
    values a call, the same bytes for every non-NaN input; NaN loses its sign. Otherwise
    the bit tricks below, which lower on every arch.
    """
    if HARDWARE:
        return tl.inline_asm_elementwise(
            _F32_TO_E4M3_PTX, "=r,r,r,r,r", [x], dtype=tl.uint8, is_pure=True, pack=4
        )
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint32)
    abs_bits = bits & 0x7FFFFFFF
    is_nan = abs_bits > 0x7F800000
    # Saturate (+-inf included) by clamping the magnitude's bit pattern: for
    # non-negative floats, bit order is value order.
    abs_bits = tl.minimum(abs_bits, 0x43E00000)

    # Normal range: keep 3 of the 23 mantissa bits, rounding to nearest even, then
    # move the exponent from bias 127 to bias 7. 448 is exact, so no overflow.
    lsb = (abs_bits >> 20) & 1
    normal = ((abs_bits + 0x7FFFF + lsb) >> 20) - 960

    # Below 2**-6 (subnormals, and values that round to zero): value / 2**-9 rounded to
    # nearest even by fp32's own rounding. The product is exact (a power of two), and
    # adding 2**23 leaves no fraction bits, so the low bits of the sum are the result.
    abs_value = abs_bits.to(tl.float32, bitcast=True)
    subnormal = (abs_value * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000

    magnitude = tl.where(abs_bits >= 0x3C800000, normal, subnormal)
    magnitude = tl.where(is_nan, 0x7F, magnitude)
    return (magnitude | sign).to(tl.uint8)


@triton.jit
def e4m3_decode(byte):
    """uint8 e4m3 bytes -> exact fp32 values (NaN preserved)."""
    b = byte.to(tl.uint32)
    sign = (b & 0x80) << 24
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal_bits = sign | ((exponent + 120) << 23) | (mantissa << 20)
    # Subnormal: mantissa * 2**-9, exact in fp32.
    subnormal = mantissa.to(tl.float32) * 0.001953125
    subnormal_bits = subnormal.to(tl.uint32, bitcast=True) | sign
    out_bits = tl.where(exponent == 0, subnormal_bits, normal_bits)
    out_bits = tl.where((b & 0x7F) == 0x7F, sign | 0x7FC00000, out_bits)
    return out_bits.to(tl.float32, bitcast=True)


# bf16 values over a power-of-two scale -> e4m3, two values a register (sm80+, no fp8
# instructions). Per bf16x2 pair X with multiplier pair S = 2**-e:
# v = X * S is exact (a power of two); a = |v|, saturated at 448 (NaN stays NaN).
# Rounding a to e4m3's step is an add: m = 2**(E + 4) for a's exponent E, at least 2**-2,
# has a bf16 ulp of 2**(E - 3), e4m3's step at a (2**-9, the subnormal step, below
# 2**-6), so s = a + m rounds a to that step, to nearest even, once. s - m counts the
# steps (8..16 from E's base, 0..8 below 2**-6), and m's exponent field / 16 - 1000
# supplies the code's exponent: the code is s - m + m / 16 - 1000 in each 16-bit lane,
# no lane ever below zero, so packed 32-bit integer arithmetic never carries across. A
# NaN lane comes out above 0x7F and the last min (as bf16 patterns, which order like
# integers when positive) makes it 0x7F. The sign comes from X, so NaN keeps it too.
def _bf16_to_e4m3_pair_ptx(x: str, multiplier: str, out: str) -> str:
    return f"""
fma.rn.bf16x2 v, {x}, {multiplier}, negative_zero;
and.b32 a, v, 0x7FFF7FFF;
min.NaN.bf16x2 a, a, e4m3_max;
and.b32 m, a, 0x7F807F80;
add.u32 m, m, 0x02000200;
max.bf16x2 m, m, subnormal_step_base;
fma.rn.bf16x2 s, a, one, m;
sub.u32 s, s, m;
shr.u32 m, m, 4;
add.u32 s, s, m;
sub.u32 s, s, 0x03E803E8;
min.bf16x2 s, s, nan_code;
shr.u32 v, {x}, 8;
and.b32 v, v, 0x00800080;
or.b32 {out}, s, v;
"""


_BF16_TO_E4M3_PTX = tl.constexpr(f"""
{{
.reg .b32 v, a, m, s, low, high, negative_zero, e4m3_max, subnormal_step_base, one, nan_code;
mov.b32 negative_zero, 0x80008000;
mov.b32 e4m3_max, 0x43E043E0;
mov.b32 subnormal_step_base, 0x3E803E80;
mov.b32 one, 0x3F803F80;
mov.b32 nan_code, 0x007F007F;
{_bf16_to_e4m3_pair_ptx("$1", "$3", "low")}
{_bf16_to_e4m3_pair_ptx("$2", "$4", "high")}
prmt.b32 $0, low, high, 0x6420;
}}
""")


@triton.jit
def e4m3_quantize(x, scale_exponent, ENCODER: tl.constexpr):
    """fp32 values x over 2**scale_exponent (int32, broadcast) as e4m3 bytes, by the fp32
    encode: sm89's hardware conversion where ENCODER (`fp8_encoder`) is "hardware"."""
    return e4m3_encode(x * exp2_int(-scale_exponent), ENCODER == "hardware")


@triton.jit
def e4m3_quantize_bf16(x, scale_exponent, ENCODER: tl.constexpr):
    """bf16 values x over 2**scale_exponent (int32, broadcast) as e4m3 bytes: the same
    bytes as `e4m3_encode(x.to(fp32) * 2**-scale_exponent)` (NaN keeps its sign but on
    "hardware", as there).

    For quantizers whose values are bf16 (or bf16-exact fp32). ENCODER (`fp8_encoder`):
    "bf16x2" takes four values in about 23 instructions on sm80/86 (the PTX above),
    where the fp32 encode takes about 15 a value, the scale included; "hardware" is
    sm89's conversion from fp32; "software" (Triton's interpreter) the fp32 bit tricks.
    Scale exponents in [-127, 126] (2**-e a normal float), which every floored amax
    gives.
    """
    if ENCODER == "bf16x2":
        multiplier = ((127 - scale_exponent) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.inline_asm_elementwise(
            _BF16_TO_E4M3_PTX,
            "=r,r,r,r,r",
            [x.to(tl.bfloat16), multiplier],
            dtype=tl.uint8,
            is_pure=True,
            pack=4,
        )
    return e4m3_quantize(x.to(tl.float32), scale_exponent, ENCODER)


def hardware_fp8_encode(device: torch.device) -> bool:
    """Whether kernels launched on `device` may encode fp8 in hardware (and multiply fp8 on
    the tensor cores): sm89 and later, by the arch Triton lowers for (the fidelity
    harness's target, else the card's own)."""
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    arch = triton.knobs.runtime.override_arch
    if arch:
        return int(arch.removeprefix("sm")) >= 89
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor >= 89


def fp8_encoder(device: torch.device) -> str:
    """How a quantizer launched on `device` encodes fp8 (its FP8_ENCODER constexpr, see
    `e4m3_quantize_bf16`): "hardware" where `hardware_fp8_encode`, "software" under
    Triton's interpreter (no PTX), "bf16x2" otherwise."""
    if hardware_fp8_encode(device):
        return "hardware"
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return "software"
    return "bf16x2"


# fp8 e4m3 -> bf16 (times a power of two), four bytes per call, for sm80+ (no fp8
# instructions). prmt sign-extends bytes b0, b1 into the two 16-bit halves of a register
# (selector nibbles with bit 3 set replicate the sign); shifting left by 4 and keeping
# bits 0x87F0 of each half leaves sign | e4m3 exponent and mantissa in bf16's fields,
# i.e. the value * 2**-120 (e4m3 subnormals become exact bf16 subnormals); one bf16x2
# fma per pair by 2**120 (times the scale) finishes it (bf16 fma keeps subnormals).
def _e4m3_to_bf16_ptx(multiplier_01: str, multiplier_23: str, setup: str = "") -> str:
    return f"""
{{
.reg .b32 pair01, pair23, negative_zero;
mov.b32 negative_zero, 0x80008000;
{setup}
prmt.b32 pair01, $2, 0, 0x9180;
prmt.b32 pair23, $2, 0, 0xB3A2;
shl.b32 pair01, pair01, 4;
shl.b32 pair23, pair23, 4;
and.b32 pair01, pair01, 0x87F087F0;
and.b32 pair23, pair23, 0x87F087F0;
fma.rn.bf16x2 $0, pair01, {multiplier_01}, negative_zero;
fma.rn.bf16x2 $1, pair23, {multiplier_23}, negative_zero;
}}
"""


# The multipliers 2**(120 + e) as operands $3, $4 (a bf16 pair each).
_E4M3_TO_BF16_SCALED_PTX = tl.constexpr(_e4m3_to_bf16_ptx("$3", "$4"))
# 2**120 built in (bf16 0x7B80 in both halves): the bytes are the only operand.
_E4M3_TO_BF16_PTX = tl.constexpr(_e4m3_to_bf16_ptx(
    "bias", "bias", ".reg .b32 bias;\nmov.b32 bias, 0x7B807B80;"))


# The PTX path's multiplier 2**(120 + e) must be a finite bf16 (at most 2**127).
MAX_SCALE_EXPONENT = 7


@triton.jit
def e4m3_dequantize_bf16(byte, scale_exponent, USE_PTX: tl.constexpr):
    """uint8 e4m3 bytes times 2**scale_exponent (int32, broadcast), as exact bf16.

    Exact for scale exponents up to MAX_SCALE_EXPONENT (tiles with amax <= 57,344) while
    the result stays a normal bf16. USE_PTX: the four-bytes-per-call path above, 2
    instructions a value, where NaN bytes decode to finite values (harmless for caches
    we wrote); otherwise (Triton's interpreter) the exact fp32 decode, then bf16.
    """
    if USE_PTX:
        # bf16 2**(120 + e): biased exponent 127 + 120 + e in bits 7..14.
        multiplier = ((scale_exponent + 247) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.inline_asm_elementwise(
            _E4M3_TO_BF16_SCALED_PTX,
            "=r,=r,r,r,r",
            [byte, multiplier],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    return (e4m3_decode(byte) * exp2_int(scale_exponent)).to(tl.bfloat16)


@triton.jit
def e4m3_to_bf16(byte, USE_PTX: tl.constexpr):
    """uint8 e4m3 bytes as exact bf16, by `e4m3_dequantize_bf16`'s paths without a scale.

    The bytes are the PTX's only operand, so Triton may move the decode past a dot
    operand's shared-memory load, into the operand's own layout; a per-tile multiplier
    operand (`e4m3_dequantize_bf16`) keeps it before, in the load's layout, with a
    round trip through shared memory after it: 1.2-1.7x slower einsums (H200, sm80/86
    mode, docs/kernels-history.md "Twentieth session").
    """
    if USE_PTX:
        return tl.inline_asm_elementwise(
            _E4M3_TO_BF16_PTX, "=r,=r,r", [byte], dtype=tl.bfloat16, is_pure=True, pack=4
        )
    return e4m3_decode(byte).to(tl.bfloat16)


@triton.jit
def dot_operand(raw, DOT_DTYPE: tl.constexpr, FP8_DOT: tl.constexpr,
                FAST_DEQUANT: tl.constexpr):
    """fp8 e4m3 bytes as a dot operand: the fp8 values themselves where the tensor cores
    multiply fp8 (sm89 and later), else decoded to exact bf16 (DOT_DTYPE)."""
    if FP8_DOT:
        operand = raw.to(tl.float8e4nv, bitcast=True)
    else:
        operand = e4m3_to_bf16(raw, FAST_DEQUANT).to(DOT_DTYPE)
    return operand


@triton.jit
def e4m3_scale_exponent(amax):
    """ceil(log2(amax / 448)) for amax > 0, exactly, from amax's bits: the exponent of
    the power-of-two (UE8M0) scale that maps a block with this absolute maximum into
    e4m3's range. Callers floor amax first (upstream uses 1e-4 or 1e-10).

    With amax = m * 2**E (1 <= m < 2) and 448 = 1.75 * 2**8, amax / 448 lies in
    (2**(E-9), 2**(E-8)] when m <= 1.75 and in (2**(E-8), 2**(E-7)) otherwise. Doing
    this with `log2` + `ceil` would depend on log2's approximate lowering.
    """
    bits = amax.to(tl.int32, bitcast=True)
    biased_exponent = (bits >> 23) & 0xFF
    above_1_75 = (bits & 0x7FFFFF) > 0x600000
    return biased_exponent - 127 - 8 + above_1_75.to(tl.int32)


@triton.jit
def exp2_int(exponent):
    """2**exponent as fp32 for integer exponents in [-126, 127], built from bits."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16(x):
    """Round fp32 to the nearest bf16 value (ties to even), kept in fp32, for finite x.

    Upstream rounds intermediates through bf16 before picking fp8 scales; doing it on
    the bits gives round-to-nearest-even everywhere, including Triton's interpreter,
    whose fp32 -> bf16 cast truncates (seen with Triton 3.9).
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _encode_kernel(x_ptr, out_ptr, num_elements, BLOCK: tl.constexpr, HARDWARE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, e4m3_encode(x, HARDWARE), mask=mask)


@triton.jit
def _quantize_bf16_kernel(x_ptr, exponent_ptr, out_ptr, num_elements, BLOCK: tl.constexpr,
                          ENCODER: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    exponent = tl.load(exponent_ptr + offsets, mask=mask, other=0)
    tl.store(out_ptr + offsets, e4m3_quantize_bf16(x, exponent, ENCODER), mask=mask)


@triton.jit
def _decode_kernel(byte_ptr, out_ptr, num_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    b = tl.load(byte_ptr + offsets, mask=mask, other=0)
    tl.store(out_ptr + offsets, e4m3_decode(b), mask=mask)


@triton.jit
def _dequantize_kernel(
    byte_ptr, exponent_ptr, out_ptr, num_elements, BLOCK: tl.constexpr, USE_PTX: tl.constexpr
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    b = tl.load(byte_ptr + offsets, mask=mask, other=0)
    exponent = tl.load(exponent_ptr + offsets, mask=mask, other=0)
    tl.store(out_ptr + offsets, e4m3_dequantize_bf16(b, exponent, USE_PTX), mask=mask)


@triton.jit
def _to_bf16_kernel(byte_ptr, out_ptr, num_elements, BLOCK: tl.constexpr,
                    USE_PTX: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    b = tl.load(byte_ptr + offsets, mask=mask, other=0)
    tl.store(out_ptr + offsets, e4m3_to_bf16(b, USE_PTX), mask=mask)


def encode_e4m3(x: torch.Tensor, hardware: bool = False) -> torch.Tensor:
    """Encode an fp32 tensor to e4m3 bytes with `e4m3_encode` (one launch; `hardware`:
    its sm89+ path)."""
    if x.dtype != torch.float32:
        raise TypeError(f"encode_e4m3 takes float32, got {x.dtype}")
    flat = x.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(flat.numel(), BLOCK_ELEMENTS),)
    _encode_kernel[grid](flat, out, flat.numel(), BLOCK=BLOCK_ELEMENTS, HARDWARE=hardware)
    return out.view(x.shape)


def quantize_e4m3_bf16(x: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes of bf16 values over 2**exponents with `e4m3_quantize_bf16` (one launch,
    `fp8_encoder`'s path for x's device)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"quantize_e4m3_bf16 takes bfloat16, got {x.dtype}")
    flat = x.contiguous().view(-1)
    flat_exponents = exponents.to(torch.int32).contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(flat.numel(), BLOCK_ELEMENTS),)
    _quantize_bf16_kernel[grid](flat, flat_exponents, out, flat.numel(), BLOCK=BLOCK_ELEMENTS,
                                ENCODER=fp8_encoder(x.device))
    return out.view(x.shape)


def decode_e4m3(data: torch.Tensor) -> torch.Tensor:
    """Decode e4m3 bytes to exact fp32 values with `e4m3_decode` (one launch)."""
    if data.dtype != torch.uint8:
        raise TypeError(f"decode_e4m3 takes uint8, got {data.dtype}")
    flat = data.contiguous().view(-1)
    exact = torch.empty(flat.shape, dtype=torch.float32, device=data.device)
    grid = (triton.cdiv(flat.numel(), BLOCK_ELEMENTS),)
    _decode_kernel[grid](flat, exact, flat.numel(), BLOCK=BLOCK_ELEMENTS)
    return exact.view(data.shape)


def decode_e4m3_bf16(data: torch.Tensor) -> torch.Tensor:
    """bf16 values of e4m3 bytes with `e4m3_to_bf16` (the PTX path on a GPU, the fp32
    path under the interpreter)."""
    flat = data.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.bfloat16, device=data.device)
    grid = (triton.cdiv(flat.numel(), BLOCK_ELEMENTS),)
    _to_bf16_kernel[grid](flat, out, flat.numel(), BLOCK=BLOCK_ELEMENTS,
                          USE_PTX=not triton.knobs.runtime.interpret)
    return out.view(data.shape)


def dequantize_e4m3_bf16(data: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """bf16 values of e4m3 bytes times 2**exponents with `e4m3_dequantize_bf16` (the
    PTX path on a GPU, the fp32 path under the interpreter)."""
    flat = data.contiguous().view(-1)
    flat_exponents = exponents.to(torch.int32).contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.bfloat16, device=data.device)
    grid = (triton.cdiv(flat.numel(), BLOCK_ELEMENTS),)
    _dequantize_kernel[grid](
        flat,
        flat_exponents,
        out,
        flat.numel(),
        BLOCK=BLOCK_ELEMENTS,
        USE_PTX=not triton.knobs.runtime.interpret,
    )
    return out.view(data.shape)


def quantize_e4m3_bf16_reference(x: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """torch reference for `e4m3_quantize_bf16`: torch's encode of x * 2**-exponents in
    fp32, NaN keeping its sign."""
    return encode_e4m3_reference(x.float() * torch.exp2(-exponents.double()).float())


def dequantize_e4m3_bf16_reference(data: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """torch reference for `e4m3_dequantize_bf16` on non-NaN bytes."""
    return (decode_e4m3_reference(data) * torch.exp2(exponents.double()).float()).to(torch.bfloat16)


def encode_e4m3_reference(x: torch.Tensor) -> torch.Tensor:
    """torch reference for `e4m3_encode`: saturate finite values, keep NaN as 0x7F|sign."""
    x = x.float()
    saturated = x.clamp(-E4M3_MAX, E4M3_MAX)
    finite_bytes = saturated.nan_to_num(0.0).to(torch.float8_e4m3fn).view(torch.uint8)
    nan_bytes = torch.where(torch.signbit(x), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(torch.isnan(x), nan_bytes, finite_bytes)


def decode_e4m3_reference(data: torch.Tensor) -> torch.Tensor:
    """torch reference for `e4m3_decode`."""
    return data.view(torch.float8_e4m3fn).float()
