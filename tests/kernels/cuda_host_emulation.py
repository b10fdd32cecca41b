"""A CUDA kernel's own source run on the CPU, for its tests on machines without a GPU.

The source is compiled as host C++ with `cuda_host_emulation.h` (CUDA's built-ins, and
the Ampere instructions of `ampere_shared.cuh` emulated), and each block runs with a
fiber a CUDA thread, all on one OS thread. So the kernel's indexing, masks, pipeline and
warp-level data movement run as written, on small shapes; the instructions' semantics are
the emulator's reading of the PTX ISA, which only a GPU run confirms. A warp-wide
instruction is two barrier waits of 32 fibers, a switch of stacks each.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

HEADER = Path(__file__).with_name("cuda_host_emulation.h")
LAUNCHER = """#include "{source}"
extern "C" const char* launch_emulated(const void* params, unsigned x, unsigned y,
                                       unsigned z, int threads) {{
  const auto& p = *static_cast<const {params}*>(params);
  emulation::fault[0] = '\\0';
  emulation::run_grid(dim3{{x, y, z}}, threads, [&] {{ {kernel}(p); }});
  return emulation::fault[0] == '\\0' ? nullptr : emulation::fault;
}}
extern "C" unsigned block_barriers(unsigned block) {{
  return emulation::block_barriers.at(block);
}}
"""


class EmulatedKernel:
    """`kernel` of `source` (taking one `params` struct by value) built for the CPU."""

    def __init__(self, source: Path, kernel: str, params: str, defines: dict[str, int],
                 build_dir: Path) -> None:
        compiler = shutil.which("g++")
        if compiler is None:
            pytest.skip("no g++ to build the CPU emulation with")
        launcher = build_dir / f"{kernel}_emulated.cpp"
        launcher.write_text(LAUNCHER.format(source=source, params=params, kernel=kernel))
        library = build_dir / f"{kernel}_emulated.so"
        macros = [f"-D{name}={value}" for name, value in sorted(defines.items())]
        result = subprocess.run(
            [compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-include",
             str(HEADER), "-DBACKPORT_HOST_EMULATION", f"-I{source.parent}", *macros,
             str(launcher), "-o", str(library)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"g++ failed on {source.name}:\n{result.stderr}")
        self._library = ctypes.CDLL(str(library))
        self._library.launch_emulated.argtypes = [
            ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_int]
        self._library.launch_emulated.restype = ctypes.c_char_p
        self._library.block_barriers.argtypes = [ctypes.c_uint]
        self._library.block_barriers.restype = ctypes.c_uint
        self._blocks = 0

    def launch(self, grid: tuple[int, int, int], threads: int,
               params: ctypes.Structure) -> None:
        """Runs the grid; AssertionError for an access the GPU would fault on (a misaligned
        cp.async or ldmatrix, a copy past shared memory)."""
        fault = self._library.launch_emulated(ctypes.addressof(params), *grid, threads)
        self._blocks = grid[0] * grid[1] * grid[2]
        assert fault is None, f"the kernel faulted: {fault.decode()}"

    def block_barriers(self) -> list[int]:
        """The barriers (`__syncthreads`) each block of the last launch passed, x fastest."""
        return [self._library.block_barriers(block) for block in range(self._blocks)]
