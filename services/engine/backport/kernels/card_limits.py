"""What the target cards hold per block and per SM, and how many blocks of a kernel they
keep resident at once.

The H200 we test on has 228 KB of shared memory an SM; an A100 has 164 KB and the sm86/89
cards 100 KB. A kernel that fits all of them per block still runs more blocks an SM on
the H200 than on the card it is meant for, so its timings there flatter it unless the
launch is held to the target's residency (`resident_blocks`). Figures from NVIDIA's CUDA
C++ Programming Guide, "Compute Capabilities" table.
"""

from __future__ import annotations

from dataclasses import dataclass

REGISTER_ALLOCATION_UNIT = 256  # registers are granted to a warp in these units (sm80-89)


@dataclass(frozen=True)
class CardLimits:
    shared_per_block: int  # opt-in dynamic shared memory of one block, bytes
    shared_per_sm: int
    reserved_shared_per_block: int  # the driver's own share of each resident block
    threads_per_sm: int
    blocks_per_sm: int
    registers_per_sm: int = 65_536


CARD_LIMITS = {
    "sm80": CardLimits(166_912, 167_936, 1_024, 2_048, 32),  # A100
    "sm86": CardLimits(101_376, 102_400, 1_024, 1_536, 16),  # RTX A6000, RTX 3090
    "sm89": CardLimits(101_376, 102_400, 1_024, 1_536, 24),  # RTX 4090, L40S
}


def resident_blocks(arch: str, threads: int, shared_bytes: int,
                    registers: int | None = None) -> int:
    """Blocks of `threads` threads and `shared_bytes` of dynamic shared memory that one SM
    of `arch` keeps resident; `registers` a thread, when given, limits them too."""
    limits = CARD_LIMITS[arch]
    if shared_bytes > limits.shared_per_block:
        return 0
    warps = -(-threads // 32)
    blocks = min(limits.blocks_per_sm, limits.threads_per_sm // (warps * 32),
                 limits.shared_per_sm // (shared_bytes + limits.reserved_shared_per_block))
    if registers is not None:
        per_warp = -(-registers * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
        blocks = min(blocks, limits.registers_per_sm // per_warp // warps)
    return blocks
