"""Resident blocks an SM from the target cards' limits, against figures worked out by hand
with the occupancy rules (1 KB of shared memory kept per block, registers granted a warp
in units of 256), and the padding that holds an H200 to a target's blocks."""

from __future__ import annotations

import re
import subprocess

import pytest
import triton
import triton.language as tl

from services.engine.backport.kernels.arch_fidelity import (
    KERNEL_SHARED_KEY,
    TARGET_REGISTERS_KEY,
    cubin_registers,
    emulation_stages_hook,
    hold_to_target_residency,
    target_build,
)
from services.engine.backport.kernels.card_limits import (
    CardLimits,
    Fp8InstructionError,
    fp8_instructions,
    refuse_fp8_instructions,
    holding_shared_bytes,
    resident_blocks,
)
from tests.kernels.offline_build import build_in_child


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


H200 = CardLimits(shared_per_block=232_448, shared_per_sm=233_472, reserved_shared_per_block=1_024,
                  threads_per_sm=2_048, blocks_per_sm=32)


@pytest.mark.parametrize(
    ("arch", "threads", "shared", "registers"),
    [
        ("sm80", 128, 43_552, 128),  # the CUDA decode's 4-block build: 4 an SM unpadded, 3
        ("sm86", 128, 43_552, 128),  # the same on an sm86 target: 2
        ("sm86", 128, 0, None),      # 1,536 threads an SM: 12 blocks, where the H200 runs 16
        ("sm80", 256, 40_000, None),
    ],
)
def test_padding_holds_the_h200_to_the_target(arch: str, threads: int, shared: int,
                                              registers: int | None) -> None:
    target = resident_blocks(arch, threads, shared, registers)
    assert H200.resident_blocks(threads, shared, registers) > target
    padded = holding_shared_bytes(H200, threads, shared, target, registers)
    assert H200.resident_blocks(threads, padded, registers) == target
    assert H200.resident_blocks(threads, padded - 1, registers) == target + 1  # the least


@pytest.mark.parametrize(
    ("arch", "threads", "shared", "registers"),
    [
        ("sm86", 128, 43_552, 255),  # the 2-block build: its registers already hold it to 2
        ("sm80", 128, 43_552, 168),  # the 3-block build: its registers hold it to 3
        ("sm80", 128, 0, None),      # 16 blocks of 128 threads on both
    ],
)
def test_no_padding_where_the_h200_holds_no_more(arch: str, threads: int, shared: int,
                                                 registers: int | None) -> None:
    target = resident_blocks(arch, threads, shared, registers)
    assert holding_shared_bytes(H200, threads, shared, target, registers) == shared


def test_padding_needs_a_block_to_hold() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        holding_shared_bytes(H200, 128, 200_000, 0)


@pytest.mark.parametrize(
    ("arch", "num_warps", "shared", "held_blocks"),
    [
        ("sm80", 4, 32_768, 4),    # the K gather: 6 an SM on the H200 unpadded
        ("sm86", 4, 32_768, 3),
        ("sm86", 4, 0, 12),        # held by sm86's 1,536 threads an SM
        ("sm80", 4, 0, 16),        # the same on both: nothing to pad
        ("sm86", 4, 120_000, 1),   # over sm86's per-block limit: launched as it is
    ],
)
def test_compiled_triton_metadata_holds_the_launch(arch: str, num_warps: int, shared: int,
                                                   held_blocks: int) -> None:
    metadata = {"shared": shared, "num_warps": num_warps, "warp_size": 32}
    hold_to_target_residency(metadata, arch, H200)
    assert metadata[KERNEL_SHARED_KEY] == shared
    threads = num_warps * 32
    assert H200.resident_blocks(threads, metadata["shared"]) == held_blocks
    if resident_blocks(arch, threads, shared) in (0, H200.resident_blocks(threads, shared)):
        assert metadata["shared"] == shared


def test_target_registers_hold_the_launch_too() -> None:
    """The sparse prefill before the twenty-first session: 50,304 B, which an A100 holds 3
    of, but 186 registers a thread from sm_80's ptxas, which it holds 2 of."""
    metadata = {"shared": 50_304, "num_warps": 4, "warp_size": 32}
    hold_to_target_residency(metadata, "sm80", H200, registers=186)
    assert H200.resident_blocks(128, metadata["shared"]) == 2
    without = {"shared": 50_304, "num_warps": 4, "warp_size": 32}
    hold_to_target_residency(without, "sm80", H200)
    assert H200.resident_blocks(128, without["shared"]) == 3


@pytest.mark.parametrize(("card_registers", "padded"), [(80, False), (None, True)])
def test_the_cards_own_registers_can_leave_a_launch_unpadded(card_registers: int | None,
                                                              padded: bool) -> None:
    """The ratio-128 window merge: 2 warps, 256 B, 80 registers from both ptxas builds, so
    an A100 and the H200 each hold 12 blocks. Counting only the target's registers, the
    twenty-second session padded it to 16,936 B, which took the H200's L1: 10% slower."""
    metadata = {"shared": 256, "num_warps": 2, "warp_size": 32}
    hold_to_target_residency(metadata, "sm80", H200, registers=80, card_registers=card_registers)
    assert (metadata["shared"] > 256) is padded
    assert H200.resident_blocks(64, metadata["shared"], 80) == 12


def test_the_cards_own_registers_do_not_lift_a_hold_they_do_not_make() -> None:
    """The old sparse prefill again, with the 127 registers the H200's ptxas gave it: the
    H200 would hold 3 of its blocks, so it is still padded to the A100's 2."""
    metadata = {"shared": 50_304, "num_warps": 4, "warp_size": 32}
    hold_to_target_residency(metadata, "sm80", H200, registers=186, card_registers=127)
    assert H200.resident_blocks(128, metadata["shared"], 127) == 2


# A kernel of 64 loads, 32 adds and 64 stores a thread, written for sm80 as the emulation
# selects PTX for every target; it needs no more than its 64 values' registers and spills
# nothing on any target.
_SIXTY_FOUR_FLOATS_PTX = (
    ".version 8.0\n.target sm_80\n.address_size 64\n"
    ".visible .entry add_pairs(.param .u64 p)\n{\n"
    "  .reg .b64 %rd<3>;\n  .reg .f32 %f<65>;\n"
    "  ld.param.u64 %rd1, [p];\n  cvta.to.global.u64 %rd2, %rd1;\n"
    + "".join(f"  ld.global.volatile.f32 %f{i}, [%rd2+{4 * i}];\n" for i in range(1, 65))
    + "".join(f"  add.f32 %f{i}, %f{i}, %f{65 - i};\n" for i in range(1, 33))
    + "".join(f"  st.global.f32 [%rd2+{4 * i}], %f{i};\n" for i in range(1, 65))
    + "  ret;\n}\n"
)


@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm89"])
def test_target_build_reads_registers_from_the_targets_ptxas(arch: str) -> None:
    build = target_build(_SIXTY_FOUR_FLOATS_PTX, arch)
    assert 16 <= build.registers <= 80
    assert build.spill_bytes == 0


def test_cubin_registers_reads_the_cubin_the_card_runs(tmp_path) -> None:
    """The card's registers come from the cubin itself: the same count its ptxas prints."""
    from triton.backends.nvidia.compiler import get_ptxas

    source, cubin = tmp_path / "kernel.ptx", tmp_path / "kernel.cubin"
    source.write_text(_SIXTY_FOUR_FLOATS_PTX)
    built = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90", str(source), "-o",
                            str(cubin)], capture_output=True, text=True, check=True)
    printed = re.findall(r"Used (\d+) registers", built.stderr)
    assert cubin_registers(cubin.read_bytes()) == int(printed[-1])


def test_fp8_instructions_are_found_in_ptx() -> None:
    """What the emulation refuses in sm80/86 mode, since the H200's ptxas would take it."""
    ptx = """
	cvt.rn.satfinite.e4m3x2.f32 low, %f1, %f2;
	@%p1 cvt.rn.f16x2.e4m3x2 %r3, %rs1;
	mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e5m2.f32 {%f1}, {%r1}, {%r2}, {%f2};
	cvt.rn.bf16x2.f32 %r4, %f1, %f2;
	prmt.b32 %r5, %r1, 0, 37248;
	// e4m3 bytes, decoded in software
	call.uni e4m3_decode, (%r1);
"""
    assert fp8_instructions(ptx) == [
        "cvt.rn.f16x2.e4m3x2",
        "cvt.rn.satfinite.e4m3x2.f32",
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e5m2.f32",
    ]
    assert fp8_instructions(b"\tcvt.rn.satfinite.e4m3x2.f32 low, %f1, %f2;\n") == [
        "cvt.rn.satfinite.e4m3x2.f32"]
    assert fp8_instructions("\tcvt.rn.bf16x2.f32 %r4, %f1, %f2;\n") == []


@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm89"])
def test_fp8_instructions_are_refused_only_without_fp8_hardware(arch: str) -> None:
    ptx = "\tcvt.rn.satfinite.e4m3x2.f32 low, %f1, %f2;\n"
    if arch == "sm89":
        refuse_fp8_instructions(ptx, arch, "_encode_kernel")
        return
    with pytest.raises(Fp8InstructionError,
                       match=f"_encode_kernel: fp8 instructions not supported on {arch}"):
        refuse_fp8_instructions(ptx, arch, "_encode_kernel")
    refuse_fp8_instructions("\tcvt.rn.bf16x2.f32 %r4, %f1, %f2;\n", arch, "_encode_kernel")


@triton.jit
def _doubled_bf16_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    values = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, values + values)


def emulated_build(arch: str | None) -> dict[str, object]:
    """PTX and metadata of `_doubled_bf16_kernel` compiled for an H200 (no GPU needed),
    emulating `arch` through the harness's hook, or plainly when `arch` is None."""
    from triton.backends.compiler import GPUTarget

    if arch is not None:
        triton.knobs.runtime.override_arch = arch
        triton.knobs.runtime.add_stages_inspection_hook = emulation_stages_hook(arch, 90, H200)
    source = triton.compiler.ASTSource(
        fn=_doubled_bf16_kernel, signature={"x_ptr": "*bf16", "out_ptr": "*bf16",
                                            "BLOCK": "constexpr"}, constexprs={"BLOCK": 128})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    metadata = compiled.metadata._asdict()
    return {"ptx": compiled.asm["ptx"], "shared": metadata["shared"]} | {
        key: metadata[key] for key in (KERNEL_SHARED_KEY, TARGET_REGISTERS_KEY) if key in metadata}


@pytest.mark.parametrize("arch", ["sm80", "sm86"])
def test_emulated_compile_selects_ptx_for_the_target(arch: str) -> None:
    """Triton lowers for the target but selects PTX for the card present: for an H200
    a bf16 add becomes `add.bf16`, which needs sm90, and the target's ptxas refuses it.
    The harness's hook selects for the target (sm80/86 have `fma.rn.bf16`)."""
    # Plain first: the emulated build installs the hook for the rest of the process.
    plain, emulated = build_in_child("tests.kernels.test_card_limits:emulated_build",
                                     [dict(arch=None), dict(arch=arch)])
    assert "add.bf16" in plain["ptx"], "the H200's own PTX no longer shows the difference"
    assert f".target sm_{arch.removeprefix('sm')}\n" in emulated["ptx"]
    assert "add.bf16" not in emulated["ptx"]
    assert "fma.rn.bf16" in emulated["ptx"]
    assert 0 < emulated[TARGET_REGISTERS_KEY] <= 255
    assert emulated["shared"] >= emulated[KERNEL_SHARED_KEY]
