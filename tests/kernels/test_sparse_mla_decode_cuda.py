"""The CUDA sparse MLA decode against the same plain-torch reference as the Triton one.

CUDA C++ cannot run under Triton's interpreter, so on a machine without a GPU only the
build check runs (where a CUDA compiler and ptxas exist): the PTX the launcher loads must
assemble for sm80 and sm86 without spills. On a CUDA card, `--gpu-arch` builds the kernel
for that arch's instruction set (compute_80 PTX, JIT-compiled for the card present).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.arch_fidelity import SHARED_MEMORY_LIMIT_BYTES
from services.engine.backport.kernels.card_limits import CARD_LIMITS, resident_blocks
from services.engine.backport.kernels.cuda_module import context_sm_count
from services.engine.backport.kernels.sparse_mla_decode_cuda import (
    DEFAULT_MIN_BLOCKS,
    DEFAULT_PARTIAL_DTYPE,
    KERNEL_NAME,
    SOURCE,
    THREADS,
    LoadedSparseMla,
    choose_num_splits,
    decode_launch,
    decode_ptx,
    load_decode,
    sparse_mla_decode_cuda,
)
from tests.kernels.cuda_host_emulation import EmulatedKernel
from tests.kernels.offline_build import assemble_ptx, cuda_arch_or_skip, ptx_or_skip
from tests.kernels.test_sparse_mla_decode import (
    GPU_CASES,
    INTERPRETER_CASES,
    assert_near_the_fastest,
    check_against_reference,
    run_case,
    split_case_id,
    split_sweep_cases,
)

CASES = GPU_CASES + INTERPRETER_CASES
REGISTERS_PER_SM = 65536  # sm80, sm86 and sm89 alike
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA card")


def _ptx_or_skip(arch: str, min_blocks: int = 4) -> bytes:
    """The PTX the launcher loads for `arch`; skips without a CUDA compiler."""
    return ptx_or_skip(decode_ptx, arch, min_blocks=min_blocks)


@pytest.mark.parametrize("min_blocks", [2, 3, 4])
@pytest.mark.parametrize("arch", ["sm80", "sm86"])
def test_cuda_decode_assembles_for_ampere_without_spills(arch: str, min_blocks: int) -> None:
    """ptxas for the real Ampere target: no fp8 instruction can pass it, and spills would
    show here first."""
    registers, spills = assemble_ptx(_ptx_or_skip(arch, min_blocks), arch)
    assert spills == 0
    budget = REGISTERS_PER_SM // (THREADS * min_blocks)
    assert registers <= budget, f"{registers} registers: fewer than {min_blocks} blocks an SM"


@pytest.fixture(scope="module")
def emulated_decode(tmp_path_factory: pytest.TempPathFactory):
    """The kernel's source built for the CPU, a build a blocks-an-SM count (which picks
    between overlapped and one-after-another steps, q in registers or staged)."""
    builds: dict[int, EmulatedKernel] = {}

    def build(min_blocks: int) -> EmulatedKernel:
        if min_blocks not in builds:
            builds[min_blocks] = EmulatedKernel(
                SOURCE, KERNEL_NAME, "SparseMlaParams",
                {"SPARSE_MLA_DECODE_MIN_BLOCKS": min_blocks},
                tmp_path_factory.mktemp("emulated"))
        return builds[min_blocks]

    return build


@pytest.mark.parametrize(("min_blocks", "partial_dtype"),
                         [(2, torch.bfloat16), (3, torch.bfloat16), (2, torch.float32)])
@pytest.mark.parametrize("case_index", range(len(INTERPRETER_CASES)))
def test_cuda_decode_matches_reference_in_a_cpu_emulation_of_the_gpu(
        case_index: int, min_blocks: int, partial_dtype: torch.dtype, emulated_decode,
        kernel_device: str) -> None:
    """The kernel's own code (slot runs, padding, the copy pipeline, online softmax,
    fragment movement) on the CPU, its Ampere instructions emulated (`cuda_host_emulation`);
    the combine is the Triton one, as on the GPU."""
    case = INTERPRETER_CASES[case_index]
    kernel = emulated_decode(min_blocks)

    def decode(*, q, k_cache, indices, softmax_scale, topk_length=None, attn_sink=None,
               extra_k_cache=None, extra_indices=None, extra_topk_length=None,
               block_size=None, extra_block_size=None, num_splits=None):
        launch = decode_launch(q, k_cache, indices, softmax_scale, topk_length, extra_k_cache,
                               extra_indices, extra_topk_length, block_size, extra_block_size,
                               num_splits, partial_dtype)
        kernel.launch(launch.grid, THREADS, launch.params)
        if kernel_device == "cuda":  # Triton's combine runs compiled there, on GPU tensors
            launch = dataclasses.replace(launch, q=launch.q.cuda(),
                                         partial_out=launch.partial_out.cuda(),
                                         partial_lse=launch.partial_lse.cuda())
            attn_sink = attn_sink.cuda() if attn_sink is not None else None
        out, lse = launch.combine(attn_sink)
        return out.cpu(), lse.cpu()

    got, want = run_case(case, "cpu", seed=60 + case_index, decode=decode)
    check_against_reference(case, got, want)


@pytest.fixture(scope="module")
def cuda_arch(gpu_arch: str | None) -> str:
    return cuda_arch_or_skip(gpu_arch, _ptx_or_skip)


# The launcher's build (2 blocks an SM, steps overlapped, bf16 partials) runs every case.
# The 3- and 4-block builds run their steps one after another, a schedule of its own to
# check, and fp32 partials are a store path of their own: each runs the small cases
# (padding, short lists, odd splits), one split of a long list, 40 heads, a large grid.
NON_DEFAULT_BUILD_CASES = [2, 5, 6, 7, *range(len(GPU_CASES), len(CASES))]
BUILD_CASES = (
    [(index, DEFAULT_MIN_BLOCKS, DEFAULT_PARTIAL_DTYPE) for index in range(len(CASES))]
    + [
        (index, min_blocks, DEFAULT_PARTIAL_DTYPE)
        for min_blocks in (3, 4)
        for index in NON_DEFAULT_BUILD_CASES
    ]
    + [(index, DEFAULT_MIN_BLOCKS, torch.float32) for index in NON_DEFAULT_BUILD_CASES]
)


@needs_cuda
@pytest.mark.parametrize(("case_index", "min_blocks", "partial_dtype"), BUILD_CASES)
def test_cuda_decode_matches_reference(
    case_index: int, min_blocks: int, partial_dtype: torch.dtype, cuda_arch: str,
    record_max_error
) -> None:
    case = CASES[case_index]
    decode = functools.partial(sparse_mla_decode_cuda, arch=cuda_arch, min_blocks=min_blocks,
                               partial_dtype=partial_dtype)
    got, want = run_case(case, "cuda", seed=case_index, decode=decode)
    record_max_error(KERNEL_NAME, check_against_reference(case, got, want))


@needs_cuda
@pytest.mark.parametrize("min_blocks", [2, 3, 4])
def test_cuda_decode_fits_the_arch(cuda_arch: str, min_blocks: int, record_cuda_kernel) -> None:
    loaded = load_decode(cuda_arch, torch.cuda.current_device(), min_blocks=min_blocks)
    resources = loaded.kernel.resources
    record_cuda_kernel(KERNEL_NAME, loaded.shared_bytes, resources.registers,
                       resources.local_bytes)
    limit = SHARED_MEMORY_LIMIT_BYTES.get(cuda_arch)
    if limit is not None:
        assert loaded.shared_bytes <= limit
    assert resources.local_bytes == 0


@needs_cuda
@pytest.mark.parametrize("min_blocks", [2, 3, 4])
def test_cuda_decode_runs_as_many_blocks_an_sm_as_the_target_holds(
    cuda_arch: str, min_blocks: int
) -> None:
    """On a card with more shared memory an SM than the target (the H200 in sm80 mode),
    launches are padded so that the card holds no more blocks than the target would."""
    loaded = load_decode(cuda_arch, torch.cuda.current_device(), min_blocks=min_blocks)
    present = loaded.kernel.blocks_per_sm(THREADS, loaded.launch_shared_bytes)
    assert present == loaded.blocks_per_sm
    if cuda_arch in CARD_LIMITS:
        target = resident_blocks(cuda_arch, THREADS, loaded.shared_bytes,
                                 loaded.kernel.resources.registers)
        assert loaded.blocks_per_sm == min(target, loaded.kernel.blocks_per_sm(
            THREADS, loaded.shared_bytes))
        assert loaded.blocks_per_sm <= min_blocks


@needs_cuda
def test_sm_count_is_the_current_contexts_share(held_sm_count: int | None) -> None:
    """What the split rule plans for: the whole card, or a green context's SMs (as the
    harness holds the target card's and `bench/kernels.py --sms` any count), read from the
    driver, which rounds the count asked for; a nested context's share ends with it."""
    from torch.cuda import green_contexts

    device = torch.cuda.current_device()
    card = torch.cuda.get_device_properties(device).multi_processor_count
    current = held_sm_count or card
    assert context_sm_count(device) == current
    if held_sm_count is not None:
        assert held_sm_count < card
    if not green_contexts.SUPPORTED:
        pytest.skip("this torch has no green contexts")
    green = green_contexts.GreenContext.create(num_sms=16, device_id=device)
    green.set_context()
    try:
        share = context_sm_count(device)
    finally:
        green.pop_context()
    assert 16 <= share < current
    assert context_sm_count(device) == current


def _loaded_on(sm_count: int) -> LoadedSparseMla:
    """The 2-block build's launch figures on a card (or green context) of `sm_count` SMs."""
    return LoadedSparseMla(kernel=None, shared_bytes=27008, launch_shared_bytes=27008,
                        blocks_per_sm=2, sm_count=sm_count)


@pytest.mark.parametrize("case", split_sweep_cases("decode_splits_h200_sm80.json"),
                         ids=split_case_id)
def test_split_rule_picks_near_the_fastest_measured_split(case: dict) -> None:
    """Against every split count timed on the H200 in sm80 mode on green contexts of 132,
    112 and 88 SMs (near the A100's 108 and the A6000's 84): the pick was measured, and is
    within 10% of the fastest. The rule it replaced was up to 62% slower."""
    programs = case["batch"] * case["heads"] // 16
    assert_near_the_fastest(
        case, choose_num_splits(programs, case["topk"], case["window"], _loaded_on(case["sms"])))


def test_partials_are_fp32_or_bf16() -> None:
    """Checked before anything is built or launched, so it holds without a CUDA card."""
    q = torch.zeros(1, 16, layout.HEAD_DIM, dtype=torch.bfloat16)
    slots = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="partial_dtype"):
        sparse_mla_decode_cuda(q, layout.allocate_cache(2, 64, "cpu"), slots, 0.1,
                               block_size=64, partial_dtype=torch.float16)
