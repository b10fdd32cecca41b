"""Build a CUDA C++ kernel for an older card's instruction set and launch it from torch.

No compiled extension: NVRTC (the runtime compiler library that torch's CUDA wheels
bring; `nvcc` where it is absent) turns the source into PTX for a virtual arch
(compute_80 for the sm80 path), so anything that arch lacks fails to compile as on the card;
the driver JIT-compiles that PTX for the card present (an sm90 H200 runs the sm80 code
path, as Triton's arch override does). Launches go through the driver API on torch's
current stream, so CUDA graphs capture them like any torch op. PTX is cached by source
and arch under `BACKPORT_CUDA_CACHE_DIR` (default `~/.cache/backport/cuda`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.engine.backport.kernels.card_limits import (
    CARD_LIMITS,
    CardLimits,
    Fp8InstructionError,
    holding_shared_bytes,
    refuse_fp8_instructions,
    resident_blocks,
)

# CUfunction_attribute / CUdevice_attribute / CUresult values from cuda.h.
_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
_ATTRIBUTE_NUM_REGS = 4
_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_DEVICE_MULTIPROCESSOR_COUNT = 16
_DEVICE_MAX_THREADS_PER_SM = 39
_DEVICE_MAX_SHARED_PER_SM = 81
_DEVICE_MAX_REGISTERS_PER_SM = 82
_DEVICE_MAX_SHARED_PER_BLOCK_OPTIN = 97
_DEVICE_MAX_BLOCKS_PER_SM = 106
_DEVICE_RESERVED_SHARED_PER_BLOCK = 111
_CUDA_SUCCESS = 0
_DEV_RESOURCE_TYPE_SM = 1
# CUdevResource (cuda.h, CUDA 12.4+): a 4-byte type and 92 bytes of padding, then the SM
# resource, whose first field is its SM count. 144 bytes in all; the buffer leaves room
# for a driver whose struct has grown.
_DEV_RESOURCE_SM_COUNT_OFFSET = 96
_DEV_RESOURCE_BUFFER_BYTES = 512


class CudaBuildError(RuntimeError):
    """No CUDA compiler was found, or it rejected the source."""


def _arch_number(arch: str) -> int:
    if not arch.startswith("sm") or not arch[2:].isdigit():
        raise ValueError(f"arch must look like 'sm80', got {arch!r}")
    return int(arch[2:])


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def cuda_device_index(device: torch.device) -> int:
    """A CUDA device's index; "cuda" without one is the current device."""
    return device.index if device.index is not None else torch.cuda.current_device()


def ptxas_path() -> str | None:
    """The CUDA toolkit's assembler, for checking PTX against a real target; None without
    a toolkit."""
    try:
        return str(Path(nvcc_path()).with_name("ptxas"))
    except CudaBuildError:
        return shutil.which("ptxas")


def nvcc_path() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [str(Path(cuda_home) / "bin" / "nvcc")] if cuda_home else []
    candidates.append(shutil.which("nvcc") or "")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise CudaBuildError("building the CUDA kernels needs NVRTC (torch's CUDA wheels) or nvcc "
                         "(the CUDA toolkit): put nvcc on PATH or set CUDA_HOME")


def nvrtc_path() -> str | None:
    """libnvrtc from the nvidia-* wheels beside torch (cu13 or cu12 layout), else the
    system's; None when there is none (a CPU-only torch)."""
    candidates: list[str] = []
    for entry in map(Path, sys.path):
        for pattern in ("nvidia/cu*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"):
            candidates += sorted(str(found) for found in entry.glob(pattern)
                                 if "builtins" not in found.name and "alt" not in found.name)
    system = ctypes.util.find_library("nvrtc")
    if system:
        candidates.append(system)
    for candidate in candidates:
        try:
            ctypes.CDLL(candidate)
        except OSError:
            continue
        return candidate
    return None


def _nvrtc_ptx(library: ctypes.CDLL, source: Path, options: list[str]) -> bytes:
    def check(result: int, what: str) -> None:
        if result != 0:
            library.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise CudaBuildError(f"NVRTC {what} failed for {source.name}: "
                                 f"{library.nvrtcGetErrorString(result).decode()}")

    program = ctypes.c_void_p()
    check(library.nvrtcCreateProgram(ctypes.byref(program), source.read_bytes(),
                                     source.name.encode(), 0, None, None), "setup")
    try:
        encoded = [option.encode() for option in options]
        result = library.nvrtcCompileProgram(program, len(encoded),
                                             (ctypes.c_char_p * len(encoded))(*encoded))
        if result != 0:
            size = ctypes.c_size_t()
            library.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            library.nvrtcGetProgramLog(program, log)
            raise CudaBuildError(f"NVRTC failed for {source.name}:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        check(library.nvrtcGetPTXSize(program, ctypes.byref(size)), "PTX size")
        ptx = ctypes.create_string_buffer(size.value)
        check(library.nvrtcGetPTX(program, ptx), "PTX")
        return ptx.raw.rstrip(b"\0")
    finally:
        library.nvrtcDestroyProgram(ctypes.byref(program))


def compile_ptx(source: Path, arch: str, defines: dict[str, int] | None = None) -> bytes:
    """PTX of `source` for the virtual arch of `arch` (e.g. "sm80" -> compute_80), with
    `defines` as -D macros (a kernel's tunables), cached. Headers (`.cuh`) beside the
    source are on the include path and part of the cache key."""
    number = _arch_number(arch)
    nvrtc = nvrtc_path()
    compiler = nvrtc or nvcc_path()
    macros = [f"-D{name}={value}" for name, value in sorted((defines or {}).items())]
    text = b"".join(path.read_bytes() for path in [source, *sorted(source.parent.glob("*.cuh"))])
    key = hashlib.sha256(text + f"|{number}|{compiler}|{macros}".encode()).hexdigest()[:32]
    cache_dir = Path(os.environ.get("BACKPORT_CUDA_CACHE_DIR",
                                    Path.home() / ".cache" / "backport" / "cuda"))
    cached = cache_dir / f"{source.stem}-{arch}-{key}.ptx"
    if cached.is_file():
        return cached.read_bytes()
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    options = [f"-arch=compute_{number}", "-std=c++17", "-lineinfo", f"-I{source.parent}",
               *macros]
    if nvrtc is not None:
        partial.write_bytes(_nvrtc_ptx(ctypes.CDLL(nvrtc), source, options))
    else:
        result = subprocess.run([compiler, "-ptx", "-O3", *options, "-o", str(partial),
                                 str(source)], capture_output=True, text=True)
        if result.returncode != 0:
            raise CudaBuildError(f"nvcc failed for {source.name} ({arch}):\n{result.stderr}")
    # The driver JIT for a newer card would take fp8 instructions the target lacks.
    try:
        refuse_fp8_instructions(partial.read_text(), arch, source.name)
    except Fp8InstructionError:
        partial.unlink()
        raise
    partial.replace(cached)  # atomic: concurrent builders never read a half-written file
    return cached.read_bytes()


@functools.cache
def _driver() -> ctypes.CDLL:
    library = ctypes.CDLL("libcuda.so.1")
    library.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return library


def _check(driver: ctypes.CDLL, result: int, what: str) -> None:
    if result != _CUDA_SUCCESS:
        message = ctypes.c_char_p()
        driver.cuGetErrorString(result, ctypes.byref(message))
        name = message.value.decode() if message.value else f"error {result}"
        raise RuntimeError(f"CUDA driver: {what} failed: {name}")


def device_limits(device_index: int) -> CardLimits:
    """The limits of the card present, as its driver reports them."""
    driver = _driver()
    device = ctypes.c_int()
    _check(driver, driver.cuDeviceGet(ctypes.byref(device), device_index), "finding the device")

    def attribute(number: int) -> int:
        value = ctypes.c_int()
        _check(driver, driver.cuDeviceGetAttribute(ctypes.byref(value), number, device),
               "reading a device attribute")
        return value.value

    return CardLimits(
        shared_per_block=attribute(_DEVICE_MAX_SHARED_PER_BLOCK_OPTIN),
        shared_per_sm=attribute(_DEVICE_MAX_SHARED_PER_SM),
        reserved_shared_per_block=attribute(_DEVICE_RESERVED_SHARED_PER_BLOCK),
        threads_per_sm=attribute(_DEVICE_MAX_THREADS_PER_SM),
        blocks_per_sm=attribute(_DEVICE_MAX_BLOCKS_PER_SM),
        registers_per_sm=attribute(_DEVICE_MAX_REGISTERS_PER_SM),
    )


def context_sm_count(device_index: int) -> int:
    """SMs that launches from the current context may use: a green context's share of the
    card (`bench/kernels.py --sms`), else all of the card's."""
    driver = _driver()
    context = ctypes.c_void_p()
    if (hasattr(driver, "cuCtxGetDevResource")
            and driver.cuCtxGetCurrent(ctypes.byref(context)) == _CUDA_SUCCESS and context.value):
        resource = ctypes.create_string_buffer(_DEV_RESOURCE_BUFFER_BYTES)
        if driver.cuCtxGetDevResource(context, resource, _DEV_RESOURCE_TYPE_SM) == _CUDA_SUCCESS:
            start = _DEV_RESOURCE_SM_COUNT_OFFSET
            return int.from_bytes(resource.raw[start:start + 4], "little")
    device = ctypes.c_int()
    _check(driver, driver.cuDeviceGet(ctypes.byref(device), device_index), "finding the device")
    count = ctypes.c_int()
    _check(driver, driver.cuDeviceGetAttribute(ctypes.byref(count), _DEVICE_MULTIPROCESSOR_COUNT,
                                               device), "reading the SM count")
    return count.value


def blocks_per_sm(function: int, threads: int, dynamic_shared_bytes: int) -> int:
    """Blocks of a loaded kernel (`function`: a CUfunction handle, ours or Triton's) that
    one SM of its card keeps resident."""
    driver = _driver()
    blocks = ctypes.c_int()
    _check(driver, driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(function), threads,
        ctypes.c_size_t(dynamic_shared_bytes)), "computing occupancy")
    return blocks.value


def compiled_blocks_per_sm(kernel: Any, args: tuple[object, ...],
                           constants: dict[str, object]) -> int:
    """Blocks of the Triton `kernel` built for `args` and `constants` (launch options
    included) that one SM keeps resident, as the driver reports: held to the target's
    blocks under emulation, whose hold pads the build's shared memory. Compiles, does not
    launch."""
    compiled = kernel.warmup(*args, grid=(1,), **constants)
    compiled._init_handles()
    return blocks_per_sm(compiled.function, compiled.metadata.num_warps * 32,
                         compiled.metadata.shared)


@dataclass(frozen=True)
class FunctionResources:
    """What the driver reports for a loaded kernel on the card present."""

    registers: int
    local_bytes: int  # per-thread local memory: spills (and stack) after the JIT


class CudaKernel:
    """One `extern "C"` kernel of a PTX module, loaded into `device`'s primary context."""

    def __init__(self, ptx: bytes, name: str, device: torch.device) -> None:
        self._driver = _driver()
        self.device = device
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # makes the device's primary context current
            self._module = ctypes.c_void_p()
            _check(self._driver, self._driver.cuModuleLoadData(
                ctypes.byref(self._module), ctypes.c_char_p(ptx + b"\0")), f"loading {name}")
            self._function = ctypes.c_void_p()
            _check(self._driver, self._driver.cuModuleGetFunction(
                ctypes.byref(self._function), self._module, name.encode()), f"finding {name}")
        self.name = name
        self._dynamic_shared_limit = 0

    def attribute(self, attribute: int) -> int:
        value = ctypes.c_int()
        _check(self._driver, self._driver.cuFuncGetAttribute(
            ctypes.byref(value), attribute, self._function), "reading a kernel attribute")
        return value.value

    @property
    def resources(self) -> FunctionResources:
        return FunctionResources(registers=self.attribute(_ATTRIBUTE_NUM_REGS),
                                 local_bytes=self.attribute(_ATTRIBUTE_LOCAL_SIZE_BYTES))

    def read_int_global(self, name: str) -> int:
        """A `__constant__ int` of the module (a layout constant the source defines)."""
        address, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(self._driver, self._driver.cuModuleGetGlobal_v2(
            ctypes.byref(address), ctypes.byref(size), self._module, name.encode()),
            f"finding {name}")
        value = ctypes.c_int()
        with torch.cuda.device(self.device):
            _check(self._driver, self._driver.cuMemcpyDtoH_v2(
                ctypes.byref(value), address, ctypes.c_size_t(ctypes.sizeof(value))),
                f"reading {name}")
        return value.value

    def target_shared_bytes(self, arch: str, threads: int, shared_bytes: int) -> int:
        """The dynamic shared memory to launch blocks of `threads` that use `shared_bytes`
        with, so that the card present holds no more of them an SM than `arch` would
        (`card_limits`): more than they use on a card with more an SM."""
        if arch not in CARD_LIMITS:
            return shared_bytes
        registers = self.resources.registers
        card = device_limits(cuda_device_index(self.device))
        return holding_shared_bytes(card, threads, shared_bytes,
                                    resident_blocks(arch, threads, shared_bytes, registers),
                                    registers)

    def blocks_per_sm(self, threads: int, dynamic_shared_bytes: int) -> int:
        self._allow_shared(dynamic_shared_bytes)
        return blocks_per_sm(self._function.value, threads, dynamic_shared_bytes)

    def launch(self, grid: tuple[int, int, int], threads: int, dynamic_shared_bytes: int,
               params: ctypes.Structure) -> None:
        """Launches with one by-value struct argument on torch's current stream."""
        self._allow_shared(dynamic_shared_bytes)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        arguments = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
        _check(self._driver, self._driver.cuLaunchKernel(
            self._function, *grid, threads, 1, 1, dynamic_shared_bytes,
            ctypes.c_void_p(stream), arguments, None), f"launching {self.name}")

    def _allow_shared(self, dynamic_shared_bytes: int) -> None:
        # Above 48 KB a kernel must opt in to dynamic shared memory, once.
        if dynamic_shared_bytes > self._dynamic_shared_limit:
            _check(self._driver, self._driver.cuFuncSetAttribute(
                self._function, _ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_shared_bytes),
                "raising the dynamic shared memory limit")
            self._dynamic_shared_limit = dynamic_shared_bytes
