"""Kernels built for a target card without a GPU, for tests of what a build leaves an SM: a
Triton kernel by Triton's compiler for the card's arch, then the target's ptxas (as
`arch_fidelity.target_build` runs it); a CUDA kernel's PTX by the toolkit's ptxas
(`assemble_ptx`). The suite runs under the interpreter, which replaces `triton.jit`, so
Triton builds run in a child process without it (`build_in_child`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget

from services.engine.backport.kernels.arch_fidelity import target_build
from services.engine.backport.kernels.card_limits import resident_blocks
from services.engine.backport.kernels.cuda_module import (
    CudaBuildError,
    device_arch,
    ptxas_path,
)


def build_for_target(kernel: Any, capability: int, signature: dict[str, str],
                     constexprs: dict[str, Any], aligned: tuple[str, ...] = (),
                     num_warps: int = 4, num_stages: int = 3) -> dict[str, int]:
    """Shared memory, registers and spilled bytes of `kernel` compiled for sm`capability`.
    `signature` types the non-constexpr arguments (default "i32"); `aligned` names those a
    launch specializes as multiples of 16 (pointers and strides of contiguous tensors)."""
    full = {name: signature.get(name, "i32") for name in kernel.arg_names}
    full.update({name: "constexpr" for name in constexprs})
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = triton.compiler.ASTSource(fn=kernel, signature=full, constexprs=constexprs,
                                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    build = target_build(compiled.asm["ptx"], f"sm{capability}")
    return {"shared": compiled.metadata.shared, "threads": num_warps * 32,
            "registers": build.registers, "spill_bytes": build.spill_bytes}


def build_in_child(function: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls `function` ("module:name", returning a dict of plain values, such as
    `build_for_target`'s) once for each of `calls` (keyword arguments, plain values), in
    order, in one child process without the interpreter and with an empty Triton cache (a
    cached build would skip the compile stages these builds are about). The child lowers
    for the arch each call asks for, not for the one a fidelity run set for this process
    (Triton's `override_arch` knob sets its variable in the environment)."""
    module, name = function.split(":")
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH")}
    arguments = json.dumps(json.dumps(calls))
    code = (f"import json; from {module} import {name}; "
            f"print(json.dumps([{name}(**call) for call in json.loads({arguments})]))")
    with tempfile.TemporaryDirectory() as cache:
        child = subprocess.run([sys.executable, "-c", code], env=env | {"TRITON_CACHE_DIR": cache},
                               capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.splitlines()[-1])


def programs_an_sm(arch: str, build: dict[str, int]) -> int:
    """The target's resident programs an SM for a build, by its shared memory, threads and
    registers."""
    return resident_blocks(arch, build["threads"], build["shared"], build["registers"])


def assemble_ptx(ptx: bytes, arch: str) -> tuple[int, int]:
    """Registers a thread and spilled bytes of a CUDA kernel's PTX assembled for `arch`
    ("sm80") by the CUDA toolkit's ptxas (NVRTC's and nvcc's PTX is newer than Triton's
    ptxas takes); skips the test without a toolkit."""
    ptxas = ptxas_path()
    if ptxas is None:
        pytest.skip("no ptxas (CUDA toolkit) to assemble with")
    build = target_build(ptx.decode(), arch, ptxas)
    return build.registers, build.spill_bytes


def ptx_or_skip(build: Callable[..., bytes], *args: Any, **kwargs: Any) -> bytes:
    """A CUDA kernel's PTX from its launcher's `build`; skips the test where no CUDA
    compiler is installed (NVRTC or nvcc)."""
    try:
        return build(*args, **kwargs)
    except CudaBuildError as exc:
        if "needs NVRTC" in str(exc):
            pytest.skip(str(exc))
        raise


def cuda_arch_or_skip(gpu_arch: str | None, build: Callable[[str], bytes]) -> str:
    """The arch a CUDA kernel's GPU tests build for (`--gpu-arch`, else the card's own);
    skips them without a CUDA card or a compiler for `build`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA card")
    arch = gpu_arch or device_arch(torch.device("cuda"))
    ptx_or_skip(build, arch)
    return arch
