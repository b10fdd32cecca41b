"""Compile Triton kernels as an older card would, on the newer card that is present.

On an H200 (sm90) we prove kernels meant for sm80/86/89: Triton lowers them with the
target arch's instruction set (`knobs.runtime.override_arch`), so anything the target
lacks (`tl.float8e4nv` on sm80/86, wgmma, TMA) fails exactly as on that card. An
inspection hook replaces the last two stages: PTX is selected for the target too (Triton
would pick it for the card present), and only the PTX -> cubin step targets the real
card, so the kernel still runs and its results can be checked.

The card itself allows more shared memory than the target does. A compiled kernel's own
shared memory is held against the target's per-block limit (`SHARED_MEMORY_LIMIT_BYTES`),
and its launches ask for more where that is what keeps the card to the blocks an SM the
target holds (`card_limits.holding_shared_bytes`), so timings here are not flattered by
an H200's larger SM. The target's blocks count its registers as the target's own ptxas
allocates them (`target_build`): the H200's ptxas can give the same PTX far fewer. The
card's blocks count its own build's registers (`cubin_registers`), so a launch they
already hold is not padded: padding takes the card's L1. `hold_sm_count` runs everything
that follows on a green context of the target card's SMs, so split rules plan, and
launches run, for that many. fp8 instructions in a kernel's PTX (inline PTX gets past
Triton's own checks) fail its compile in sm80/86 mode, as the target's ptxas would. torch
ops that reach fp8 matmuls would fail on Ampere; `Fp8MatmulGuard` makes them fail here too.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from services.engine.backport.kernels.card_limits import (
    CARD_LIMITS,
    CardLimits,
    holding_shared_bytes,
    refuse_fp8_instructions,
    resident_blocks,
)
from services.engine.backport.kernels.cuda_module import context_sm_count, device_limits

SHARED_MEMORY_LIMIT_BYTES = {arch: limits.shared_per_block for arch, limits in CARD_LIMITS.items()}
# Triton's own `shared` becomes what launches ask for; the kernel's own need is kept here.
KERNEL_SHARED_KEY = "backport_kernel_shared"
# Registers a thread and spilled bytes of the kernel built by the target's ptxas.
TARGET_REGISTERS_KEY = "backport_target_registers"
TARGET_SPILLS_KEY = "backport_target_spill_bytes"
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores")
_CUOBJDUMP_REGISTERS = re.compile(r"REG:(\d+)")
_MATMUL_FUNCTIONS = frozenset(
    {
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "einsum",
        "linear",
        "_scaled_mm",
        "__matmul__",
        "__rmatmul__",
    }
)


def enable_arch_emulation(arch: str, cache_dir: str) -> None:
    """Make every later Triton compile in this process lower for `arch` (e.g. "sm80")
    and finish with a cubin for the real card. Call before the first compile."""
    import triton

    if arch not in SHARED_MEMORY_LIMIT_BYTES:
        raise ValueError(
            f"unknown arch {arch!r}; expected one of {sorted(SHARED_MEMORY_LIMIT_BYTES)}"
        )
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    triton.knobs.cache.dir = cache_dir
    major, minor = torch.cuda.get_device_capability()
    card = device_limits(torch.cuda.current_device())
    triton.knobs.runtime.override_arch = arch
    triton.knobs.runtime.add_stages_inspection_hook = emulation_stages_hook(
        arch, major * 10 + minor, card)


def emulation_stages_hook(arch: str, real_capability: int,
                          card: CardLimits) -> Callable[..., Any]:
    """Triton's stages-inspection hook for a card of `real_capability` and `card`'s limits
    emulating `arch`: PTX for the target, a cubin for the card, launches held to the
    target's blocks an SM. Install it with `override_arch` set to `arch`."""
    from triton.backends.compiler import GPUTarget

    pipeline_key = (f"backport-lower-{arch}-cubin-sm{real_capability}"
                    f"-held-to-{arch}-residency-with-both-builds-registers")
    pipeline_hash = hashlib.sha256(pipeline_key.encode()).hexdigest()

    def inspect_stages(
        backend: Any = None,
        stages: Any = None,
        options: Any = None,
        language: Any = None,
        capability: Any = None,
    ) -> tuple[str, str] | None:
        # Called with no arguments, Triton asks for a key that keeps these compiles
        # apart in its caches; called with the pipeline, we swap the last two stages.
        if backend is None:
            return pipeline_key, pipeline_hash

        def make_cubin(src: str, metadata: dict[str, Any]) -> bytes:
            # ptxas for the card present accepts fp8 instructions (inline PTX among them)
            # that the target's ptxas would reject.
            refuse_fp8_instructions(src, arch, metadata.get("name", "a Triton kernel"))
            cubin = backend.make_cubin(src, metadata, options, real_capability)
            build = target_build(src, arch)
            metadata[TARGET_REGISTERS_KEY] = build.registers
            metadata[TARGET_SPILLS_KEY] = build.spill_bytes
            hold_to_target_residency(metadata, arch, card, build.registers,
                                     cubin_registers(cubin))
            return cubin

        # Triton picks PTX instructions (add.bf16 on sm90) and the PTX version for the card
        # present even when lowering for another arch; a backend for the target picks what
        # the target's ptxas takes, and the card's newer ptxas takes that too.
        target = type(backend)(GPUTarget(backend.target.backend, capability,
                                         backend.target.warp_size))
        stages["ptx"] = lambda src, metadata: target.make_ptx(src, metadata, options, capability)
        stages["cubin"] = make_cubin
        return None

    return inspect_stages


@dataclass(frozen=True, slots=True)
class TargetBuild:
    """What the target's ptxas makes of a kernel's PTX."""

    registers: int  # a thread
    spill_bytes: int


def target_build(ptx: str, arch: str, ptxas: str | None = None) -> TargetBuild:
    """Registers and spills of `ptx` built for `arch` ("sm80") by `ptxas` (default: the one
    Triton ships). The H200's ptxas allocates differently (in the twenty-first session 127
    registers where sm_80's took 186), and registers decide how many blocks an SM the target
    holds."""
    from triton.backends.nvidia.compiler import get_ptxas

    capability = int(arch.removeprefix("sm"))
    ptxas = ptxas or get_ptxas(capability).path
    with tempfile.TemporaryDirectory() as workdir:
        source = os.path.join(workdir, "kernel.ptx")
        with open(source, "w") as file:
            file.write(ptx)
        built = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{capability}", source,
             "-o", os.path.join(workdir, "kernel.cubin")],
            capture_output=True, text=True)
    registers = _PTXAS_REGISTERS.findall(built.stderr)
    if built.returncode != 0 or not registers:
        raise RuntimeError(f"ptxas for {arch} gave no register count:\n{built.stderr}")
    spills = _PTXAS_SPILLS.findall(built.stderr)
    # A module of several kernels: its most demanding kernel's figures.
    return TargetBuild(registers=max(map(int, registers)),
                       spill_bytes=max(map(int, spills), default=0))


def cubin_registers(cubin: bytes) -> int:
    """Registers a thread of the kernel in `cubin`, as the cuobjdump Triton ships reads them."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", file.name],
                               capture_output=True, text=True)
    registers = _CUOBJDUMP_REGISTERS.findall(usage.stdout)
    if usage.returncode != 0 or not registers:
        raise RuntimeError(f"cuobjdump gave no register count:\n{usage.stdout}{usage.stderr}")
    return int(registers[-1])


def hold_to_target_residency(metadata: dict[str, Any], arch: str, card: CardLimits,
                             registers: int | None = None,
                             card_registers: int | None = None) -> None:
    """Keeps a compiled kernel's own shared memory under KERNEL_SHARED_KEY and sets what its
    launches ask for (`shared`) so that `card` holds no more of its blocks an SM than `arch`
    does, counting `registers` a thread (the target's build) and `card_registers` (the
    card's) where given. Shared memory padded past what it takes is the card's L1 lost:
    the ratio-128 window merge, which both builds give 80 registers, ran 10% slower
    padded to 16,936 B (twenty-second session) where the card's registers already held it."""
    kernel_shared = int(metadata["shared"])
    metadata[KERNEL_SHARED_KEY] = kernel_shared
    threads = metadata["num_warps"] * metadata.get("warp_size", 32)
    target = resident_blocks(arch, threads, kernel_shared, registers)
    if target > 0:  # a kernel over the target's limit runs as it is, and the report fails it
        metadata["shared"] = holding_shared_bytes(card, threads, kernel_shared, target,
                                                  card_registers)


@dataclass
class SmShare:
    """A green context of part of the card's SMs, current on this thread with its own stream
    as torch's current stream, so that every launch (Triton's, the CUDA decode's, torch's)
    runs on those SMs, and the decodes' split rules plan for them, until `release`."""

    sm_count: int  # what the driver gave, which may be more than was asked
    card_sm_count: int
    _context: Any
    _previous_stream: torch.cuda.Stream

    def release(self) -> None:
        torch.cuda.set_stream(self._previous_stream)
        self._context.pop_context()


def hold_sm_count(count: int) -> SmShare:
    """Runs what follows on `count` of the current card's SMs (the A100's 108, the A6000's
    84). The driver hands SMs out in groups, eight on the H200, so 108 gives 112."""
    from torch.cuda import green_contexts

    device = torch.cuda.current_device()
    card_sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    if not 1 <= count < card_sm_count:
        raise ValueError(f"cannot hold {count} of this card's {card_sm_count} SMs")
    if not green_contexts.SUPPORTED:
        raise RuntimeError("this torch has no CUDA green contexts to hold SMs with")
    previous_stream = torch.cuda.current_stream()
    context = green_contexts.GreenContext.create(num_sms=count, device_id=device)
    context.set_context()
    torch.cuda.set_stream(context.Stream())
    return SmShare(context_sm_count(device), card_sm_count, context, previous_stream)


class Fp8MatmulGuard(TorchFunctionMode):
    """Raises on any torch matmul that gets an fp8 operand (Ampere has no fp8 MMA)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _MATMUL_FUNCTIONS and _has_fp8_tensor(args, kwargs):
            raise RuntimeError(f"fp8 torch matmul ({func.__name__}) is not available on sm80/sm86")
        return func(*args, **kwargs)


def _has_fp8_tensor(args: Iterable[Any], kwargs: dict[str, Any]) -> bool:
    values = list(args) + list(kwargs.values())
    for value in values:
        if isinstance(value, (list, tuple)):
            if _has_fp8_tensor(value, {}):
                return True
        elif (
            isinstance(value, torch.Tensor)
            and value.dtype.itemsize == 1
            and value.dtype.is_floating_point
        ):
            return True
    return False


@dataclass(frozen=True, slots=True)
class CompiledKernelReport:
    """Resources of one compiled specialization of a Triton kernel."""

    name: str
    shared_bytes: int
    registers: int
    spills: int
    # The card's own build, which emulated timings run: its ptxas can spill where the
    # target's does not (a persistent paged-logits grid: 5,488 B a thread for sm_90, none
    # for sm_80, and 22-37x slower on the H200 in the twenty-third session).
    card_spills: int


def compiled_kernel_reports(modules: Iterable[ModuleType]) -> list[CompiledKernelReport]:
    """Every compiled specialization of the `@triton.jit` kernels defined in `modules`."""
    from triton.runtime.jit import JITFunction

    reports = []
    for module in modules:
        for value in vars(module).values():
            if not isinstance(value, JITFunction) or value.__module__ != module.__name__:
                continue
            for device_cache in getattr(value, "device_caches", {}).values():
                kernel_cache = device_cache[0] if isinstance(device_cache, tuple) else device_cache
                for kernel in list(kernel_cache.values()):
                    reports.append(_report(value.__name__, kernel))
    return reports


def _report(name: str, kernel: Any) -> CompiledKernelReport:
    # Registers and spills are known once the cubin is loaded; a kernel over the
    # real card's limits cannot load, and then only its shared memory is reported.
    try:
        kernel._init_handles()
    except Exception:  # noqa: BLE001 - triton raises OutOfResources and friends
        pass
    # In emulation the target's build is what the report is about, not the H200's.
    metadata = kernel.metadata
    return CompiledKernelReport(
        name=name,
        shared_bytes=int(getattr(metadata, KERNEL_SHARED_KEY, metadata.shared)),
        registers=int(getattr(metadata, TARGET_REGISTERS_KEY, getattr(kernel, "n_regs", -1))),
        spills=int(getattr(metadata, TARGET_SPILLS_KEY, getattr(kernel, "n_spills", -1))),
        card_spills=int(getattr(kernel, "n_spills", -1)),
    )
