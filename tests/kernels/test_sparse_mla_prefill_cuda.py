"""The CUDA sparse MLA prefill against the Triton prefill's plain-torch reference.

Without a GPU the kernel's own code runs in the CPU emulation of its Ampere instructions
(`cuda_host_emulation`), and its PTX must assemble for sm80/86/89 without spills where a
CUDA compiler and ptxas exist. On a CUDA card, `--gpu-arch` builds it for that arch.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.backport.kernels.arch_fidelity import SHARED_MEMORY_LIMIT_BYTES
from services.engine.backport.kernels.card_limits import resident_blocks
from services.engine.backport.kernels.sparse_mla_decode_cuda import SOURCE, THREADS
from services.engine.backport.kernels.sparse_mla_prefill import sparse_mla_prefill_reference
from services.engine.backport.kernels.sparse_mla_prefill_cuda import (
    DEFAULT_MIN_BLOCKS,
    KERNEL_NAME,
    load_prefill,
    prefill_launch,
    prefill_ptx,
    sparse_mla_prefill_cuda,
    takes,
)
from tests.kernels.cuda_host_emulation import EmulatedKernel
from tests.kernels.offline_build import assemble_ptx, cuda_arch_or_skip, ptx_or_skip
from tests.kernels.test_sparse_mla_prefill import (
    GPU_CASES,
    INTERPRETER_CASES,
    case_inputs,
    check_against_reference,
)

REGISTERS_PER_SM = 65536  # sm80, sm86 and sm89 alike
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA card")


def _ptx_or_skip(arch: str, min_blocks: int = DEFAULT_MIN_BLOCKS) -> bytes:
    return ptx_or_skip(prefill_ptx, arch, min_blocks=min_blocks)


@pytest.mark.parametrize("min_blocks", [2, 3])
@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm89"])
def test_cuda_prefill_assembles_for_the_targets_without_spills(arch: str,
                                                               min_blocks: int) -> None:
    registers, spills = assemble_ptx(_ptx_or_skip(arch, min_blocks), arch)
    assert spills == 0
    budget = REGISTERS_PER_SM // (THREADS * min_blocks)
    assert registers <= budget, f"{registers} registers: fewer than {min_blocks} blocks an SM"


@pytest.fixture(scope="module")
def emulated_prefill(tmp_path_factory: pytest.TempPathFactory):
    """The prefill build on the CPU, one a blocks-an-SM count (2: steps overlapped, q in
    registers; 3: steps one after another, q staged in shared memory)."""
    builds: dict[int, EmulatedKernel] = {}

    def build(min_blocks: int) -> EmulatedKernel:
        if min_blocks not in builds:
            builds[min_blocks] = EmulatedKernel(
                SOURCE, KERNEL_NAME, "SparseMlaParams",
                {"SPARSE_MLA_BF16_ROWS": 1, "SPARSE_MLA_DECODE_MIN_BLOCKS": min_blocks},
                tmp_path_factory.mktemp("emulated"))
        return builds[min_blocks]

    return build


@pytest.mark.parametrize("min_blocks", [2, 3])
@pytest.mark.parametrize("case_index", range(len(INTERPRETER_CASES)))
def test_cuda_prefill_matches_reference_in_a_cpu_emulation_of_the_gpu(
        case_index: int, min_blocks: int, emulated_prefill) -> None:
    """Row lists with holes, rows past the buffer, short lengths, a token with no key,
    sinks of -inf and +inf, heads off the 16-head tile: the kernel's own code on the CPU."""
    case = INTERPRETER_CASES[case_index]
    inputs = case_inputs(case, "cpu", seed=70 + case_index)
    launch = prefill_launch(**inputs)
    emulated_prefill(min_blocks).launch(launch.grid, THREADS, launch.params)
    got = (launch.out, launch.max_logits, launch.lse)
    check_against_reference(got, sparse_mla_prefill_reference(**inputs))


def test_cuda_prefill_refuses_what_it_cannot_run() -> None:
    inputs = case_inputs(INTERPRETER_CASES[0], "cpu", seed=6)
    with pytest.raises(TypeError, match="kv must be bfloat16"):
        prefill_launch(**{**inputs, "kv": inputs["kv"].float()})
    with pytest.raises(ValueError, match="16-byte boundaries"):
        shifted = torch.empty(100 * 512 + 4, dtype=torch.bfloat16)[4:].view(100, 1, 512)
        prefill_launch(**{**inputs, "kv": shifted})
    with pytest.raises(ValueError, match="out must be a contiguous bf16"):
        prefill_launch(**inputs, out=torch.empty_like(inputs["q"]).float())
    with pytest.raises(ValueError, match="d_v must be 512"):
        sparse_mla_prefill_cuda(**inputs, d_v=448)
    assert takes(inputs["q"], inputs["kv"])
    assert not takes(inputs["q"], inputs["kv"].float())
    assert not takes(inputs["q"], shifted.view(100, 1, 512))
    assert not takes(inputs["q"], inputs["kv"].expand(-1, 2, -1))


@pytest.fixture(scope="module")
def cuda_arch(gpu_arch: str | None) -> str:
    return cuda_arch_or_skip(gpu_arch, _ptx_or_skip)


@needs_cuda
@pytest.mark.parametrize("min_blocks", [2, 3])
@pytest.mark.parametrize("case_index", range(len(GPU_CASES + INTERPRETER_CASES)))
def test_cuda_prefill_matches_reference(case_index: int, min_blocks: int, cuda_arch: str,
                                        record_max_error) -> None:
    case = (GPU_CASES + INTERPRETER_CASES)[case_index]
    inputs = case_inputs(case, "cuda", seed=case_index)
    got = sparse_mla_prefill_cuda(**inputs, arch=cuda_arch, min_blocks=min_blocks)
    error = check_against_reference(got, sparse_mla_prefill_reference(**inputs))
    record_max_error(KERNEL_NAME, error)


@needs_cuda
def test_cuda_prefill_writes_into_out_as_vllm_passes_it(cuda_arch: str) -> None:
    """A slice of a larger buffer, contiguous or not: the result lands there only."""
    case = INTERPRETER_CASES[0]
    inputs = case_inputs(case, "cuda", seed=5)
    want, _, _ = sparse_mla_prefill_cuda(**inputs, arch=cuda_arch)
    buffer = torch.full((case.num_tokens + 2, case.num_heads + 3, 512), 7.0,
                        dtype=torch.bfloat16, device="cuda")
    for out in (buffer[1:-1, :case.num_heads].contiguous(), buffer[1:-1, :case.num_heads]):
        got, _, _ = sparse_mla_prefill_cuda(**inputs, arch=cuda_arch, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(out, want)
    assert (buffer[0] == 7).all() and (buffer[-1] == 7).all()
    assert (buffer[:, case.num_heads:] == 7).all()


@needs_cuda
@pytest.mark.parametrize("min_blocks", [2, 3])
def test_cuda_prefill_fits_the_arch(cuda_arch: str, min_blocks: int, record_cuda_kernel) -> None:
    loaded = load_prefill(cuda_arch, torch.cuda.current_device(), min_blocks=min_blocks)
    resources = loaded.kernel.resources
    record_cuda_kernel(KERNEL_NAME, loaded.shared_bytes, resources.registers,
                       resources.local_bytes)
    limit = SHARED_MEMORY_LIMIT_BYTES.get(cuda_arch)
    if limit is not None:
        assert loaded.shared_bytes <= limit
        target = resident_blocks(cuda_arch, THREADS, loaded.shared_bytes, resources.registers)
        assert loaded.blocks_per_sm == min(target, loaded.kernel.blocks_per_sm(
            THREADS, loaded.shared_bytes))
        if min_blocks == DEFAULT_MIN_BLOCKS:  # the launcher's build: two blocks on every target
            assert target >= DEFAULT_MIN_BLOCKS
    assert resources.local_bytes == 0


@needs_cuda
def test_cuda_prefill_of_no_tokens_launches_nothing(cuda_arch: str) -> None:
    inputs = case_inputs(INTERPRETER_CASES[0], "cuda", seed=7)
    empty = {**inputs, "q": inputs["q"][:0], "indices": inputs["indices"][:0],
             "topk_length": inputs["topk_length"][:0]}
    out, max_logits, lse = sparse_mla_prefill_cuda(**empty, arch=cuda_arch)
    assert out.shape == (0, *inputs["q"].shape[1:]) and max_logits.shape == lse.shape
    assert max_logits.shape == (0, inputs["q"].shape[1])
    torch.cuda.synchronize()
