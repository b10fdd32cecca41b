"""What the target cards hold per block and per SM, and how many blocks of a kernel they
keep resident at once.

The H200 we test on has 228 KB of shared memory an SM; an A100 has 164 KB and the sm86/89
cards 100 KB. A kernel that fits all of them per block still runs more blocks an SM on
the H200 than on the card it is meant for, so its timings there flatter it unless the
launch is held to the target's residency: `resident_blocks` counts the target's blocks,
`holding_shared_bytes` gives the dynamic shared memory that holds the card present to
them. Figures from NVIDIA's CUDA C++ Programming Guide, "Compute Capabilities" table;
SM counts from the named cards' data sheets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Archs without fp8 hardware: no fp8 conversions or MMAs (sm89 brought them).
ARCHS_WITHOUT_FP8 = frozenset({"sm80", "sm86"})
# A PTX instruction on e4m3/e5m2 data: cvt.rn.satfinite.e4m3x2.f32, mma ... .e4m3 ...
_FP8_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*\.(?:e4m3|e5m2)[\w.]*)",
                              re.MULTILINE)
REGISTER_ALLOCATION_UNIT = 256  # registers are granted to a warp in these units (sm80-90)


@dataclass(frozen=True)
class CardLimits:
    shared_per_block: int  # opt-in dynamic shared memory of one block, bytes
    shared_per_sm: int
    reserved_shared_per_block: int  # the driver's own share of each resident block
    threads_per_sm: int
    blocks_per_sm: int
    registers_per_sm: int = 65_536

    def resident_blocks(self, threads: int, shared_bytes: int,
                        registers: int | None = None) -> int:
        """Blocks of `threads` threads and `shared_bytes` of dynamic shared memory that one
        SM keeps resident; `registers` a thread, when given, limits them too."""
        if shared_bytes > self.shared_per_block:
            return 0
        warps = -(-threads // 32)
        blocks = min(self.blocks_per_sm, self.threads_per_sm // (warps * 32),
                     self.shared_per_sm // (shared_bytes + self.reserved_shared_per_block))
        if registers is not None:
            per_warp = -(-registers * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
            blocks = min(blocks, self.registers_per_sm // per_warp // warps)
        return blocks


CARD_LIMITS = {
    "sm80": CardLimits(166_912, 167_936, 1_024, 2_048, 32),  # A100
    "sm86": CardLimits(101_376, 102_400, 1_024, 1_536, 16),  # RTX A6000, RTX 3090
    "sm89": CardLimits(101_376, 102_400, 1_024, 1_536, 24),  # RTX 4090, L40S
}

# SMs of the card each arch is emulated as: the A100, the RTX A6000 and the RTX 4090. An arch
# spans cards of other counts (A30: 56, RTX 3090: 82, L40S: 142, more than the H200's 132).
TARGET_SM_COUNTS = {"sm80": 108, "sm86": 84, "sm89": 128}


def resident_blocks(arch: str, threads: int, shared_bytes: int,
                    registers: int | None = None) -> int:
    """`CardLimits.resident_blocks` for a target arch ("sm80", "sm86", "sm89")."""
    return CARD_LIMITS[arch].resident_blocks(threads, shared_bytes, registers)


def holding_shared_bytes(present: CardLimits, threads: int, shared_bytes: int, blocks: int,
                         registers: int | None = None) -> int:
    """The dynamic shared memory, from `shared_bytes` up, to launch blocks of `threads`
    (of `registers` each, where known) with on the card `present` so that an SM holds at
    most `blocks` of them (the target's `resident_blocks`): `shared_bytes` itself where it
    holds no more already. Only shared memory can be padded; `registers` are the present
    card's build's, which may hold it to fewer blocks than its shared memory does."""
    if blocks < 1:
        raise ValueError(f"blocks must be at least 1, got {blocks}")
    if present.resident_blocks(threads, shared_bytes, registers) <= blocks:
        return shared_bytes
    # A block over 1 / (blocks + 1) of the SM's shared memory leaves no room for one more.
    return max(shared_bytes,
               present.shared_per_sm // (blocks + 1) + 1 - present.reserved_shared_per_block)


class Fp8InstructionError(RuntimeError):
    """A kernel built for an arch without fp8 hardware has fp8 instructions."""


def refuse_fp8_instructions(ptx: str | bytes, arch: str, kernel: str) -> None:
    """Raises Fp8InstructionError where `arch` has no fp8 hardware and `ptx` needs it."""
    if arch in ARCHS_WITHOUT_FP8 and (found := fp8_instructions(ptx)):
        raise Fp8InstructionError(f"{kernel}: fp8 instructions not supported on {arch}: {found}")


def fp8_instructions(ptx: str | bytes) -> list[str]:
    """The instructions in `ptx` that need fp8 hardware. ptxas on an sm80/86 card rejects
    them; compiled for the H200 they would pass, so the emulation checks for them."""
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    return sorted(set(_FP8_INSTRUCTION.findall(text)))
