"""Inline PTX of the Triton kernels run on the CPU, for its tests on machines without a GPU.

Triton's interpreter cannot run `tl.inline_asm_elementwise`, so in CI the kernels take
their portable paths and the PTX fast paths run only on a GPU. `PtxBlock` executes such
a block's text over numpy arrays, one array element a thread, for the few instructions
the fp8 codec uses: the 32-bit integer ones, `prmt.b32`, and bf16x2 `fma.rn`, `min`,
`max` and `min.NaN`. Their semantics are this module's reading of the PTX ISA (bf16
lanes keep subnormals; a NaN result is the canonical 0x7FFF), which only a GPU run
confirms; `fma.rn.bf16x2` rounds the exact a * b + c once, as the hardware does.
"""

from __future__ import annotations

import re

import numpy as np

CANONICAL_BF16_NAN = 0x7FFF
_MASK32 = 0xFFFFFFFF


def _lanes(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return word & 0xFFFF, word >> 16


def _join(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (low & 0xFFFF) | ((high & 0xFFFF) << 16)


def bf16_values(lane: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (in uint32/uint64 arrays) as float64 values."""
    with np.errstate(invalid="ignore"):  # signalling NaN patterns
        return (lane.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _round_to_odd_f32(exact: np.ndarray, error: np.ndarray) -> np.ndarray:
    """float32 bits of exact + error (error below exact's float64 ulp), rounded to odd:
    a later rounding to nearest even at 8 bits then equals one rounding of the sum."""
    with np.errstate(over="ignore"):
        single = exact.astype(np.float32)
    bits = single.view(np.uint32).astype(np.int64)
    widened = single.astype(np.float64)
    below = (widened < exact) | ((widened == exact) & (error > 0))
    above = (widened > exact) | ((widened == exact) & (error < 0))
    inexact = below | above
    # Sign-magnitude: one step up in bits is one step away from zero.
    away = np.where(single < 0, above, below)
    nudge = inexact & ((bits & 1) == 0) & np.isfinite(single)
    bits = np.where(nudge, np.where(away, bits + 1, bits - 1), bits)
    # Below float32's smallest step: the smallest odd one, with the sum's sign.
    tiny = (single == 0) & inexact
    bits = np.where(tiny, np.where(exact < 0, 0x80000001, 1), bits)
    return bits.astype(np.uint32)


def _f32_bits_to_bf16(bits: np.ndarray) -> np.ndarray:
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(is_nan, CANONICAL_BF16_NAN, rounded & 0xFFFF).astype(np.uint64)


def _fma_bf16(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    va, vb, vc = bf16_values(a), bf16_values(b), bf16_values(c)
    with np.errstate(invalid="ignore", over="ignore"):
        product = va * vb  # exact: two 8-bit significands
        total = product + vc
        # TwoSum: the float64 sum's exact error, so the result rounds once.
        virtual = total - product
        error = (product - (total - virtual)) + (vc - virtual)
    error = np.where(np.isfinite(total), error, 0.0)
    result = _f32_bits_to_bf16(_round_to_odd_f32(total, error))
    is_nan = np.isnan(va) | np.isnan(vb) | np.isnan(vc) | np.isnan(total)
    return np.where(is_nan, CANONICAL_BF16_NAN, result)


def _bf16x2(lane_op):
    def run(a: np.ndarray, b: np.ndarray, *rest: np.ndarray) -> np.ndarray:
        halves = [_lanes(x) for x in (a, b, *rest)]
        return _join(*(lane_op(*(h[i] for h in halves)) for i in (0, 1)))
    return run


def _min_max_bf16(smaller: bool, nan_wins: bool):
    """bf16x2 min (smaller) or max: a NaN operand gives way to the other one, or with
    `.NaN` (nan_wins) makes the result NaN."""
    def lane_op(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        va, vb = bf16_values(a), bf16_values(b)
        a_nan, b_nan = np.isnan(va), np.isnan(vb)
        chosen = np.where(va <= vb if smaller else va >= vb, a, b)
        if nan_wins:
            return np.where(a_nan | b_nan, CANONICAL_BF16_NAN, chosen)
        chosen = np.where(a_nan, b, np.where(b_nan, a, chosen))
        return np.where(a_nan & b_nan, CANONICAL_BF16_NAN, chosen)
    return _bf16x2(lane_op)


def _prmt(a: np.ndarray, b: np.ndarray, selector: np.ndarray) -> np.ndarray:
    """prmt.b32's default mode: byte i of d is byte (nibble i & 7) of {b, a}, or that
    byte's sign replicated where the nibble's bit 3 is set."""
    pool = (a & _MASK32) | ((b & _MASK32) << 32)
    out = np.zeros(np.broadcast(a, b).shape, dtype=np.uint64)
    for i in range(4):
        nibble = (selector >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (pool >> (np.uint64(8) * (nibble & np.uint64(7)))) & np.uint64(0xFF)
        sign = np.where((byte & np.uint64(0x80)) != 0, np.uint64(0xFF), np.uint64(0))
        byte = np.where((nibble & np.uint64(8)) != 0, sign, byte)
        out |= byte << np.uint64(8 * i)
    return out


_INSTRUCTIONS = {
    "mov.b32": lambda a: a,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "add.u32": lambda a, b: (a + b) & _MASK32,
    "sub.u32": lambda a, b: (a - b) & _MASK32,
    "shl.b32": lambda a, b: (a << b) & _MASK32,
    "shr.u32": lambda a, b: a >> b,
    "prmt.b32": _prmt,
    "fma.rn.bf16x2": _bf16x2(_fma_bf16),
    "min.bf16x2": _min_max_bf16(smaller=True, nan_wins=False),
    "min.NaN.bf16x2": _min_max_bf16(smaller=True, nan_wins=True),
    "max.bf16x2": _min_max_bf16(smaller=False, nan_wins=False),
}


class PtxBlock:
    """One inline-asm block's text; `run` binds its $0.. operands and executes it."""

    def __init__(self, text: str) -> None:
        self.statements = []
        for statement in text.replace("{", ";").replace("}", ";").split(";"):
            statement = statement.strip()
            if not statement or statement.startswith(".reg"):
                continue
            opcode, _, operands = statement.partition(" ")
            if opcode not in _INSTRUCTIONS:
                raise NotImplementedError(f"PTX instruction {opcode!r} is not emulated")
            self.statements.append((opcode, [o.strip() for o in operands.split(",")]))

    def run(self, num_outputs: int, *inputs: np.ndarray) -> list[np.ndarray]:
        """Executes the block with $0..$(num_outputs - 1) as outputs and the inputs
        (32-bit words, one array element a thread) as the operands after them."""
        registers: dict[str, np.ndarray] = {
            f"${num_outputs + i}": np.asarray(x, dtype=np.uint64) & _MASK32
            for i, x in enumerate(inputs)
        }

        def value(operand: str) -> np.ndarray:
            if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", operand):
                return np.uint64(int(operand, 0))
            return registers[operand]

        for opcode, (destination, *sources) in self.statements:
            registers[destination] = np.asarray(
                _INSTRUCTIONS[opcode](*(value(s) for s in sources)), dtype=np.uint64
            ) & _MASK32
        return [registers[f"${i}"] for i in range(num_outputs)]
