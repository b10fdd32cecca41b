"""The CUDA paged indexer logits against the same plain-torch reference as the Triton ones.

Without a GPU the kernel's own source (both builds: fp16 mma for sm80/86, fp8 mma for
sm89) runs in the CPU emulation (`cuda_host_emulation`) on small shapes, and its PTX is
assembled for sm80, sm86 and sm89 where a CUDA toolkit exists. On a CUDA card, `--gpu-arch`
builds it for that arch's instruction set.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from services.engine.backport.kernels.arch_fidelity import SHARED_MEMORY_LIMIT_BYTES
from services.engine.backport.kernels.card_limits import (
    CARD_LIMITS,
    fp8_instructions,
    resident_blocks,
)
from services.engine.backport.kernels import paged_mqa_logits as triton_logits
from services.engine.backport.kernels.paged_mqa_logits import paged_mqa_logits_reference
from services.engine.backport.kernels.paged_mqa_logits_cuda import (
    BALANCED_KERNEL_NAME,
    BALANCED_MAX_ROWS,
    DEFAULT_MIN_BLOCKS,
    DEFAULT_STAGES,
    KERNEL_NAME,
    KEYS_PER_STEP,
    SOURCES,
    THREADS,
    WAVES,
    MAX_ROWS,
    LoadedLogits,
    balanced_for_rows,
    keys_per_program_for_rows,
    load_logits,
    logits_launch,
    logits_ptx,
    paged_mqa_logits_cuda,
    takes,
)
from tests.kernels.cuda_host_emulation import EmulatedKernel
from tests.kernels.offline_build import assemble_ptx, cuda_arch_or_skip, ptx_or_skip
from tests.kernels.test_mqa_logits import GPU_PAGED, PagedCase, assert_logits_match, paged_inputs

REGISTERS_PER_SM = 65536  # sm80, sm86 and sm89 alike
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA card")


def _ptx_or_skip(arch: str, block_size: int = 64, min_blocks: int = DEFAULT_MIN_BLOCKS,
                 balanced: bool = False) -> bytes:
    return ptx_or_skip(logits_ptx, arch, block_size, min_blocks=min_blocks, balanced=balanced)


@pytest.mark.parametrize("balanced", [False, True], ids=["row-grid", "balanced"])
@pytest.mark.parametrize("min_blocks", [2, 3])
@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm89"])
def test_cuda_logits_assemble_for_their_targets_without_spills(arch: str, min_blocks: int,
                                                               balanced: bool) -> None:
    """ptxas for the real target: no fp8 instruction can pass it for Ampere, and spills
    would show here first. sm89's build multiplies fp8 on the tensor cores. At 168
    registers (3 blocks) sm80's and sm86's ptxas keep one word of the balanced kernel in
    local memory, loaded once a step (from L1)."""
    ptx = _ptx_or_skip(arch, min_blocks=min_blocks, balanced=balanced)
    assert bool(fp8_instructions(ptx)) == (arch == "sm89")
    registers, spills = assemble_ptx(ptx, arch)
    assert spills <= (4 if balanced and min_blocks == 3 and arch != "sm89" else 0)
    assert registers <= REGISTERS_PER_SM // (THREADS * min_blocks)


class CudaCase(NamedTuple):
    case: PagedCase
    keys_per_program: int | None  # None: the launcher's
    stages: int = DEFAULT_STAGES
    min_blocks: int = DEFAULT_MIN_BLOCKS
    blocks_per_row: int | None = None  # None: the launcher's (on a GPU), a block a chunk


# Small shapes the emulation runs in seconds: 16-, 64-, 128- and 256-token pages (whose
# steps start inside a page), 2 and 3 stages, rows ending mid-step and mid-page,
# speculative rows with their own lengths, requests of no key, clean and plain logits,
# fewer heads than the 64 staged, and blocks that take one, two and every chunk of their
# row.
EMULATED = [
    CudaCase(PagedCase(3, 1, 64, 128, 64, 700, per_draft_lengths=False, clean=True), 384,
             blocks_per_row=1),
    CudaCase(PagedCase(2, 2, 40, 128, 16, 200, per_draft_lengths=True, clean=False,
                       empty_requests=1), 128, stages=3),
    CudaCase(PagedCase(3, 2, 20, 128, 128, 390, per_draft_lengths=False, clean=True,
                       empty_requests=1), 128, blocks_per_row=2),
    CudaCase(PagedCase(2, 1, 16, 128, 32, 600, per_draft_lengths=False, clean=False), 128,
             blocks_per_row=2),
    CudaCase(PagedCase(2, 1, 24, 128, 256, 900, per_draft_lengths=False, clean=True), 128,
             blocks_per_row=3),
]


@pytest.fixture(scope="module")
def emulated_logits(tmp_path_factory: pytest.TempPathFactory):
    builds: dict[tuple[int, int, bool, str], EmulatedKernel] = {}

    def build(block_size: int, stages: int, fp8_mma: bool = False,
              kernel: str = KERNEL_NAME) -> EmulatedKernel:
        if (block_size, stages, fp8_mma, kernel) not in builds:
            builds[block_size, stages, fp8_mma, kernel] = EmulatedKernel(
                SOURCES[kernel == BALANCED_KERNEL_NAME], kernel, "LogitsParams",
                {"PAGED_MQA_LOGITS_BLOCK_SIZE": block_size, "PAGED_MQA_LOGITS_STAGES": stages,
                 "PAGED_MQA_LOGITS_FP8_MMA": int(fp8_mma)},
                tmp_path_factory.mktemp("emulated"))
        return builds[block_size, stages, fp8_mma, kernel]

    return build


def assert_emulated_logits_match(launch, inputs: dict, clean: bool,
                                 requests: list[int] | None = None) -> None:
    """An emulated launch's logits (NaN before it) against the reference; without clean,
    the columns past a row's keys must be untouched. `requests` (one row each): only
    these, against a reference of them alone."""
    got = launch.logits
    if requests is not None:
        inputs = {**inputs, **{name: inputs[name][requests]
                               for name in ("q", "weights", "context_lens", "block_tables")}}
        got = got[requests]
    want = paged_mqa_logits_reference(**inputs)
    if not clean:
        written = torch.isfinite(want)
        assert torch.isnan(got[~written]).all(), "wrote past a row's keys"
        got[~written] = float("-inf")
    assert_logits_match(got, want, clean)


@pytest.mark.parametrize("fp8_mma", [False, True], ids=["fp16-mma", "fp8-mma"])
@pytest.mark.parametrize("case_index", range(len(EMULATED)))
def test_cuda_logits_match_reference_in_a_cpu_emulation_of_the_gpu(
        case_index: int, fp8_mma: bool, emulated_logits) -> None:
    """The kernel's own code (page lookups, the copy pipeline, q's permuted staging, the
    fp8 decode or sm89's fp8 operands, fragment layouts, the reduce-scatter) on the CPU, its
    instructions emulated."""
    case, keys_per_program, stages, _, blocks_per_row = EMULATED[case_index]
    inputs = paged_inputs(case, "cpu", seed=70 + case_index)
    launch = logits_launch(**inputs, clean_logits=case.clean, keys_per_program=keys_per_program,
                           blocks_per_row=blocks_per_row)
    launch.logits.fill_(float("nan"))  # a column left unwritten must not pass for written
    emulated_logits(case.block_size, stages, fp8_mma).launch(launch.grid, THREADS,
                                                              launch.params)
    assert_emulated_logits_match(launch, inputs, case.clean)


def test_each_cuda_logits_block_walks_only_its_own_keys(emulated_logits) -> None:
    """A block's 128-key steps (one barrier each, counted by the emulation) are those of
    its own chunks' keys and no more. A block that walked on past them wrote nothing wrong
    (the extra keys lie past its row), so the reference checks cannot see it; on the GPU it
    cost 10-50x the time."""
    case = PagedCase(3, 1, 16, 128, 64, 1000, per_draft_lengths=False, clean=False)
    keys_per_program = 256
    inputs = paged_inputs(case, "cpu", seed=81)
    launch = logits_launch(**inputs, clean_logits=False, keys_per_program=keys_per_program,
                           blocks_per_row=2)
    kernel = emulated_logits(case.block_size, DEFAULT_STAGES)
    kernel.launch(launch.grid, THREADS, launch.params)
    rows, blocks, _ = launch.grid
    chunks = -(-case.max_model_len // keys_per_program)
    want = []
    for block in range(blocks):
        for length in inputs["context_lens"].tolist():
            keys = [min(max(length - chunk * keys_per_program, 0), keys_per_program)
                    for chunk in range(block, chunks, blocks)]
            want.append(sum(-(-count // KEYS_PER_STEP) for count in keys))
    assert rows == len(inputs["context_lens"])
    assert kernel.block_barriers() == want


# The balanced kernel on the same kinds of shapes, with grids of one block, of a few, and
# of more blocks than steps (blocks of no share); rows whose requests have no key; 140
# rows, so that counting the rows' steps takes two passes of 128; speculative rows. Most
# of the 140 rows have no key: the emulation's time goes with the keys.
EMULATED_BALANCED = [
    (EMULATED[0].case, 4),
    (EMULATED[1].case, 1),
    (EMULATED[2].case, 5),
    (EMULATED[4].case, 40),
    (PagedCase(70, 2, 16, 128, 16, 160, per_draft_lengths=True, clean=True,
               empty_requests=58), 9),
]


def balanced_launch(case: PagedCase, blocks: int, seed: int):
    inputs = paged_inputs(case, "cpu", seed=seed)
    launch = logits_launch(**inputs, clean_logits=case.clean, keys_per_program=None,
                           balanced_blocks=blocks)
    launch.logits.fill_(float("nan"))  # a column left unwritten must not pass for written
    return inputs, launch


@pytest.mark.parametrize("fp8_mma", [False, True], ids=["fp16-mma", "fp8-mma"])
@pytest.mark.parametrize("case_index", range(len(EMULATED_BALANCED)))
def test_balanced_cuda_logits_match_reference_in_a_cpu_emulation_of_the_gpu(
        case_index: int, fp8_mma: bool, emulated_logits) -> None:
    """The balanced kernel's shares: rows cut between blocks mid-row, q staged again where a
    share moves on, the clean spread over the grid."""
    case, blocks = EMULATED_BALANCED[case_index]
    inputs, launch = balanced_launch(case, blocks, seed=90 + case_index)
    emulated_logits(case.block_size, DEFAULT_STAGES, fp8_mma, BALANCED_KERNEL_NAME).launch(
        launch.grid, THREADS, launch.params)
    assert_emulated_logits_match(launch, inputs, case.clean)


def test_balanced_kernel_counts_its_most_rows_in_a_cpu_emulation_of_the_gpu(
        emulated_logits) -> None:
    """BALANCED_MAX_ROWS rows, all but the first and the last without a key: the rows'
    counts fill the room the kernel keeps for them, and the blocks find the last row's
    steps past all the empty ones."""
    case = PagedCase(BALANCED_MAX_ROWS, 1, 16, 128, 16, 32, per_draft_lengths=False,
                     clean=False, empty_requests=BALANCED_MAX_ROWS - 2)
    inputs, launch = balanced_launch(case, 3, seed=11)
    emulated_logits(case.block_size, DEFAULT_STAGES, False, BALANCED_KERNEL_NAME).launch(
        launch.grid, THREADS, launch.params)
    assert torch.isnan(launch.logits[1:-1]).all(), "wrote a row of no key"
    ends = [0, BALANCED_MAX_ROWS - 1]  # the reference of 8,192 rows takes half a minute
    assert (inputs["context_lens"][ends] > 0).all()
    assert_emulated_logits_match(launch, inputs, case.clean, requests=ends)


def counting_barriers(num_rows: int) -> int:
    """Barriers of the balanced kernel's count of the rows' steps, which every block
    passes: one a 128-row pass and one after."""
    return -(-num_rows // THREADS) + 1


def balanced_barriers(row_steps: list[int], blocks: int) -> list[int]:
    """Barriers each block of the balanced kernel passes: those of the count; where its
    share is not empty, one before its steps, one a step and one a row its share moves on
    to."""
    rows_of_steps = [row for row, steps in enumerate(row_steps) for _ in range(steps)]
    total = len(rows_of_steps)
    counting = counting_barriers(len(row_steps))
    barriers = []
    for block in range(blocks):
        first = block * (total // blocks) + min(block, total % blocks)
        share = rows_of_steps[first:first + total // blocks + (block < total % blocks)]
        barriers.append(counting + (1 + len(share) + len(set(share)) - 1 if share else 0))
    return barriers


@pytest.mark.parametrize(("case_index", "blocks"), [(0, 4), (4, 9), (3, 40), (1, 3)])
def test_each_balanced_block_takes_its_even_share(case_index: int, blocks: int,
                                                  emulated_logits) -> None:
    """Blocks' steps (a barrier each, counted by the emulation) differ by one at most, in
    row order, with q staged again only where a share enters a new row. A block that
    walked too far or too little would write nothing wrong where another block covers the
    keys, so the reference checks alone could not see it."""
    case = EMULATED_BALANCED[case_index][0]
    inputs, launch = balanced_launch(case, blocks, seed=7)
    kernel = emulated_logits(case.block_size, DEFAULT_STAGES, False, BALANCED_KERNEL_NAME)
    kernel.launch(launch.grid, THREADS, launch.params)
    lengths = inputs["context_lens"]
    next_n = case.next_n
    if lengths.dim() == 1:  # a request's length, less the drafts after each row
        lengths = lengths[:, None] - next_n + 1 + torch.arange(next_n)
    lengths = lengths.clamp(0, case.max_model_len).reshape(-1).tolist()
    row_steps = [-(-length // KEYS_PER_STEP) for length in lengths]
    grid_blocks = launch.grid[0]  # at most the rows' widest steps
    assert grid_blocks == min(blocks, len(row_steps) * -(-case.max_model_len // KEYS_PER_STEP))
    assert kernel.block_barriers() == balanced_barriers(row_steps, grid_blocks)
    idle = balanced_barriers(row_steps, grid_blocks).count(counting_barriers(len(row_steps)))
    assert idle == max(0, grid_blocks - sum(row_steps))


def test_balanced_grid_is_one_round_and_its_rule() -> None:
    """One round of the blocks the card keeps resident, never more than the rows' widest
    steps; steps of up to BALANCED_MAX_ROWS rows take it, more the row kernel. Needs no
    GPU."""
    case = PagedCase(2, 1, 16, 128, 64, 300, per_draft_lengths=False, clean=False)
    inputs = paged_inputs(case, "cpu", seed=3)
    launch = logits_launch(**inputs, clean_logits=False, keys_per_program=None,
                           balanced_blocks=lambda: 324)
    assert launch.grid == (2 * 3, 1, 1)  # 2 rows of 3 steps at their widest
    assert launch.params.next_n_reciprocal == 1 << 32 and launch.params.num_rows == 2
    loaded = LoadedLogits(kernel=None, shared_bytes=50176, launch_shared_bytes=50176,
                          blocks_per_sm=3, sm_count=108)
    assert loaded.resident_blocks == 324
    assert balanced_for_rows(1) and balanced_for_rows(2) and balanced_for_rows(64)
    assert balanced_for_rows(BALANCED_MAX_ROWS) and not balanced_for_rows(BALANCED_MAX_ROWS + 1)


@pytest.mark.parametrize("next_n", [1, 2, 3, 4, 7])
def test_rows_request_by_the_reciprocal_is_exact(next_n: int) -> None:
    """The kernels' row / next_n as (row x ceil(2^32 / next_n)) >> 32, for every row the
    launcher takes."""
    rows = torch.arange(MAX_ROWS, dtype=torch.int64)
    reciprocal = -(-(1 << 32) // next_n)
    assert torch.equal((rows * reciprocal) >> 32, rows // next_n)


def test_cuda_logits_refuse_what_they_do_not_take() -> None:
    """Checked before anything is built or launched, so it holds without a CUDA card."""
    case = PagedCase(1, 1, 16, 32, 16, 64, per_draft_lengths=False, clean=False)
    inputs = paged_inputs(case, "cpu", seed=1)
    assert not takes(inputs["q"], inputs["kv_cache"])
    with pytest.raises(ValueError, match="128-dim heads"):
        paged_mqa_logits_cuda(**inputs)
    case = PagedCase(1, 1, 16, 128, 64, 256, per_draft_lengths=False, clean=False)
    inputs = paged_inputs(case, "cpu", seed=1)
    assert takes(inputs["q"], inputs["kv_cache"])
    with pytest.raises(ValueError, match="keys_per_program"):
        paged_mqa_logits_cuda(**inputs, keys_per_program=200)
    case = PagedCase(BALANCED_MAX_ROWS + 1, 1, 1, 128, 16, 16, per_draft_lengths=False,
                     clean=False)
    inputs = paged_inputs(case, "cpu", seed=1)
    with pytest.raises(ValueError, match=f"at most {BALANCED_MAX_ROWS} rows"):
        logits_launch(**inputs, clean_logits=False, keys_per_program=None, balanced_blocks=4)


@pytest.mark.parametrize(("rows", "chunks"), [(1, 1024), (8, 512), (64, 256), (64, 8),
                                             (2000, 256), (0, 64)])
def test_grid_is_a_few_rounds_of_resident_blocks_at_most(rows: int, chunks: int) -> None:
    """Blocks a row under the cap: every row gets at least one block and at most a block a
    chunk, and a grid of more than one block a row stays within `WAVES` rounds of what an
    A100 (108 SMs, 3 blocks) keeps resident. Needs no GPU."""
    loaded = LoadedLogits(kernel=None, shared_bytes=50176, launch_shared_bytes=50176,
                          blocks_per_sm=3, sm_count=108)
    blocks = loaded.blocks_per_row(rows, chunks)
    assert 1 <= blocks <= chunks
    if blocks > 1:
        assert rows * blocks <= WAVES * 3 * 108 + rows
    if rows * chunks <= WAVES * 3 * 108:
        assert blocks == chunks  # few enough rows: a block a chunk, as before the cap


def timed_cuts() -> list[dict]:
    data = Path(__file__).with_name("data") / "paged_logits_cuda_keys_per_program_h200.json"
    return json.loads(data.read_text())["cases"]


@pytest.mark.parametrize(
    "case", timed_cuts(),
    ids=lambda case: f"{case['arch']}-rows{case['rows']}-keys{case['keys']}")
def test_cuda_keys_per_program_against_the_timed_cuts(case: dict) -> None:
    """Against steps timed at 128 to 2,048 keys a chunk (H200, sm80/86/89 mode): the pick
    was timed, is within 1.4x of the fastest and at most 15% slower than the Triton
    kernel's rule, which the CUDA kernel took before (a row's best cut depends on its
    length, which the launcher cannot read; the slowest case, one row of 32k keys in sm86
    mode, takes 1.14x)."""
    times = {int(keys): ms for keys, ms in case["ms"].items()}
    pick = keys_per_program_for_rows(case["rows"])
    assert pick in times
    assert times[pick] <= 1.4 * min(times.values())
    assert times[pick] <= 1.15 * times[triton_logits.keys_per_program_for_rows(case["rows"])]


def test_cuda_keys_per_program_pay_over_the_triton_rule() -> None:
    """Over every timed step, the CUDA rule's cuts take at most 0.92x the time of the
    Triton kernel's (geometric mean; 0.915 in the thirtieth session's timings, 0.88 in the
    twenty-eighth's of the kernel before its leaner step loop)."""
    ratios = [case["ms"][str(keys_per_program_for_rows(case["rows"]))]
              / case["ms"][str(triton_logits.keys_per_program_for_rows(case["rows"]))]
              for case in timed_cuts()]
    assert math.prod(ratios) ** (1 / len(ratios)) <= 0.92


@pytest.fixture(scope="module")
def cuda_arch(gpu_arch: str | None) -> str:
    return cuda_arch_or_skip(gpu_arch, _ptx_or_skip)


GPU_CASES = [
    *[CudaCase(case, case.keys_per_program) for case in GPU_PAGED],
    # The launcher's own keys a program: one row (128), five rows (512).
    CudaCase(PagedCase(1, 1, 64, 128, 64, 5000, per_draft_lengths=False, clean=True), None),
    CudaCase(PagedCase(5, 1, 64, 128, 64, 3000, per_draft_lengths=False, clean=False), None),
    CudaCase(PagedCase(4, 2, 64, 128, 256, 4096, per_draft_lengths=True, clean=True,
                       empty_requests=1), 1024),
    # Blocks that take several chunks of a wide row.
    CudaCase(PagedCase(6, 1, 64, 128, 64, 20000, per_draft_lengths=False, clean=False), 512,
             blocks_per_row=3),
    CudaCase(PagedCase(3, 2, 64, 128, 64, 9000, per_draft_lengths=True, clean=True), 256,
             blocks_per_row=5),
    # The other builds: 3 stages, 3 blocks an SM.
    CudaCase(GPU_PAGED[1], 1024, stages=3),
    CudaCase(GPU_PAGED[0], 1024, min_blocks=3),
]


@needs_cuda
@pytest.mark.parametrize("balanced", [False, True], ids=["row-grid", "balanced"])
@pytest.mark.parametrize("case_index", range(len(GPU_CASES)))
def test_cuda_logits_match_reference(case_index: int, balanced: bool, cuda_arch: str,
                                     record_max_error) -> None:
    """Each case on both kernels; the row grid with the case's keys a chunk and blocks a
    row."""
    case, keys_per_program, stages, min_blocks, blocks_per_row = GPU_CASES[case_index]
    inputs = paged_inputs(case, "cuda", seed=case_index)
    got = paged_mqa_logits_cuda(**inputs, clean_logits=case.clean,
                                keys_per_program=keys_per_program, arch=cuda_arch,
                                stages=stages, min_blocks=min_blocks,
                                blocks_per_row=None if balanced else blocks_per_row,
                                balanced=balanced)
    want = paged_mqa_logits_reference(**inputs)
    if not case.clean:
        got[~torch.isfinite(want)] = float("-inf")
    record_max_error(BALANCED_KERNEL_NAME if balanced else KERNEL_NAME,
                     assert_logits_match(got, want, case.clean))


@needs_cuda
@pytest.mark.parametrize("balanced", [False, True], ids=["row-grid", "balanced"])
@pytest.mark.parametrize("min_blocks", [2, 3])
def test_cuda_logits_fit_the_arch(cuda_arch: str, min_blocks: int, balanced: bool,
                                  record_cuda_kernel) -> None:
    """Within the target's shared memory, no spills after the JIT of the 2-block build,
    and launches held to the blocks an SM the target would keep. (The H200's ptxas spills
    a few bytes of the 3-block build at its 168 registers; the target's:
    `test_cuda_logits_assemble_for_their_targets_without_spills`.)"""
    loaded = load_logits(cuda_arch, torch.cuda.current_device(), 64, min_blocks=min_blocks,
                         balanced=balanced)
    resources = loaded.kernel.resources
    record_cuda_kernel(BALANCED_KERNEL_NAME if balanced else KERNEL_NAME, loaded.shared_bytes,
                       resources.registers, resources.local_bytes)
    limit = SHARED_MEMORY_LIMIT_BYTES.get(cuda_arch)
    if limit is not None:
        assert loaded.shared_bytes <= limit
    if min_blocks == 2:
        assert resources.local_bytes == 0
    if cuda_arch in CARD_LIMITS:
        target = resident_blocks(cuda_arch, THREADS, loaded.shared_bytes, resources.registers)
        assert target >= 2
        present = loaded.kernel.blocks_per_sm(THREADS, loaded.launch_shared_bytes)
        assert present == min(target, loaded.kernel.blocks_per_sm(THREADS,
                                                                   loaded.shared_bytes))
