"""The indexer's logits (DeepGEMM's fp8_mqa_logits and fp8_paged_mqa_logits) against their
plain-torch references."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.engine.backport.kernels.mqa_logits import (
    DEFAULT_BLOCK_N,
    DEFAULT_TOKENS,
    mqa_logits,
    mqa_logits_reference,
)
from services.engine.backport.kernels.paged_mqa_logits import (
    DOUBLE_BUFFER_MIN_STEPS,
    DOUBLE_BUFFER_STAGES,
    KEYS_PER_PROGRAM,
    SCALE_BYTES,
    SINGLE_BUFFER_STAGES,
    keys_per_program_for_rows,
    paged_mqa_logits,
    paged_mqa_logits_reference,
    pipeline_stages,
)
from tests.kernels.offline_build import build_for_target, build_in_child, programs_an_sm


def fp8_values(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random fp8 e4m3 values over most of the format's range, a few of them zero."""
    x = torch.randn(shape, generator=generator) * 4
    x[torch.rand(shape, generator=generator) < 0.05] = 0.0
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def assert_logits_match(got: torch.Tensor, want: torch.Tensor, clean: bool) -> float:
    """In-range logits match; with `clean`, -inf exactly where the reference has it.
    Returns the max abs error relative to the largest logit."""
    got, want = got.cpu(), want.cpu()
    in_range = torch.isfinite(want)
    scale = max(1.0, want[in_range].abs().max().item()) if in_range.any() else 1.0
    error = (got[in_range] - want[in_range]).abs().max().item() / scale if in_range.any() else 0
    # Products of fp8 values are exact in bf16 x bf16 -> fp32; only sums round.
    assert error < 1e-5
    if clean:
        assert torch.equal(torch.isneginf(got), ~in_range)
    return error


@dataclass(frozen=True)
class RaggedCase:
    num_tokens: int
    num_heads: int
    head_dim: int
    num_keys: int
    clean: bool
    tokens_per_program: int = DEFAULT_TOKENS
    keys_per_program: int = 2048
    block_n: int = DEFAULT_BLOCK_N


GPU_RAGGED = [
    RaggedCase(300, 64, 128, 5000, clean=False),
    # Two tokens a program need 64-key steps to fit sm86's shared memory.
    RaggedCase(301, 64, 128, 3000, clean=True, tokens_per_program=2, keys_per_program=512,
               block_n=64),
    RaggedCase(37, 40, 128, 700, clean=True, block_n=64),
]
INTERPRETER_RAGGED = [
    RaggedCase(6, 20, 32, 150, clean=True, keys_per_program=64),
    RaggedCase(5, 16, 32, 90, clean=False, tokens_per_program=2, block_n=32),
]


def ragged_inputs(case: RaggedCase, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Tokens of three requests laid end to end: each sees a causal prefix of its own keys;
    one token sees nothing."""
    generator = torch.Generator().manual_seed(seed)
    q = fp8_values((case.num_tokens, case.num_heads, case.head_dim), generator)
    k = fp8_values((case.num_keys, case.head_dim), generator)
    k_scale = torch.rand(case.num_keys, generator=generator) + 0.01
    weights = torch.randn(case.num_tokens, case.num_heads, generator=generator)
    starts = torch.tensor([0, case.num_keys // 3, case.num_keys // 2])
    request = torch.randint(0, 3, (case.num_tokens,), generator=generator)
    ks = starts[request]
    ke = ks + torch.randint(0, case.num_keys - case.num_keys // 2 + 1, (case.num_tokens,),
                            generator=generator)
    ke[0] = ks[0]
    inputs = dict(q=q, k=k, k_scale=k_scale, weights=weights,
                  cu_seqlen_ks=ks.to(torch.int32), cu_seqlen_ke=ke.to(torch.int32))
    return {name: value.to(device) for name, value in inputs.items()}


@pytest.mark.parametrize("case_index", range(len(GPU_RAGGED)))
def test_mqa_logits_match_reference(kernel_device: str, case_index: int,
                                    record_max_error) -> None:
    cases = GPU_RAGGED if kernel_device == "cuda" else INTERPRETER_RAGGED
    if case_index >= len(cases):
        pytest.skip("large shapes run on a CUDA card only")
    case = cases[case_index]
    inputs = ragged_inputs(case, kernel_device, seed=case_index)
    got = mqa_logits(**inputs, clean_logits=case.clean,
                     tokens_per_program=case.tokens_per_program,
                     keys_per_program=case.keys_per_program, block_n=case.block_n)
    want = mqa_logits_reference(**inputs)
    record_max_error("_mqa_logits_kernel", assert_logits_match(got, want, case.clean))


@dataclass(frozen=True)
class PagedCase:
    batch: int
    next_n: int
    num_heads: int
    head_dim: int
    block_size: int
    max_model_len: int
    per_draft_lengths: bool
    clean: bool
    keys_per_program: int = 1024
    empty_requests: int = 0  # requests after the first with context length 0: rows of no keys


GPU_PAGED = [
    PagedCase(8, 1, 64, 128, 64, 4096, per_draft_lengths=False, clean=False),
    PagedCase(5, 2, 64, 128, 64, 3000, per_draft_lengths=True, clean=True, empty_requests=2),
    PagedCase(3, 2, 40, 128, 16, 700, per_draft_lengths=False, clean=True, keys_per_program=256),
]
INTERPRETER_PAGED = [
    PagedCase(3, 1, 20, 32, 16, 100, per_draft_lengths=False, clean=True, keys_per_program=64),
    PagedCase(2, 2, 16, 32, 8, 70, per_draft_lengths=True, clean=False),
    PagedCase(3, 3, 16, 32, 8, 40, per_draft_lengths=False, clean=True, keys_per_program=16,
              empty_requests=1),
]


def paged_inputs(case: PagedCase, device: str, seed: int) -> dict[str, object]:
    """A cache of shuffled pages with padding after each page's scales, as vLLM's view."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_request = -(-case.max_model_len // case.block_size)
    num_blocks = case.batch * blocks_per_request + 3
    row_bytes = case.head_dim + SCALE_BYTES
    page_bytes = case.block_size * row_bytes + 64
    pages = torch.randint(0, 256, (num_blocks, page_bytes), generator=generator,
                          dtype=torch.uint8)
    values = fp8_values((num_blocks, case.block_size, case.head_dim), generator)
    scales = torch.rand(num_blocks, case.block_size, generator=generator) + 0.01
    values_end = case.block_size * case.head_dim
    pages[:, :values_end] = values.view(torch.uint8).reshape(num_blocks, -1)
    pages[:, values_end : values_end + case.block_size * SCALE_BYTES] = (
        scales.view(torch.uint8).reshape(num_blocks, -1))
    kv_cache = pages.as_strided((num_blocks, case.block_size, 1, row_bytes),
                                (page_bytes, row_bytes, row_bytes, 1))
    block_tables = torch.randperm(num_blocks, generator=generator)[
        : case.batch * blocks_per_request].reshape(case.batch, blocks_per_request)
    shape = (case.batch, case.next_n) if case.per_draft_lengths else (case.batch,)
    context_lens = torch.randint(case.next_n, case.max_model_len + 1, shape, generator=generator)
    context_lens.view(-1)[0] = case.max_model_len
    context_lens[1 : 1 + case.empty_requests] = 0
    q = fp8_values((case.batch, case.next_n, case.num_heads, case.head_dim), generator)
    weights = torch.randn(case.batch * case.next_n, case.num_heads, generator=generator)
    inputs = dict(q=q, kv_cache=kv_cache, weights=weights,
                  context_lens=context_lens.to(torch.int32),
                  block_tables=block_tables.to(torch.int32))
    return {**{name: value.to(device) for name, value in inputs.items()},
            "max_model_len": case.max_model_len}


@pytest.mark.parametrize("case_index", range(len(GPU_PAGED)))
def test_paged_mqa_logits_match_reference(kernel_device: str, case_index: int,
                                          record_max_error) -> None:
    cases = GPU_PAGED if kernel_device == "cuda" else INTERPRETER_PAGED
    if case_index >= len(cases):
        pytest.skip("large shapes run on a CUDA card only")
    case = cases[case_index]
    inputs = paged_inputs(case, kernel_device, seed=case_index)
    got = paged_mqa_logits(**inputs, clean_logits=case.clean,
                           keys_per_program=case.keys_per_program)
    want = paged_mqa_logits_reference(**inputs)
    record_max_error("_paged_mqa_logits_kernel", assert_logits_match(got, want, case.clean))


@pytest.mark.parametrize("num_stages", [SINGLE_BUFFER_STAGES, DOUBLE_BUFFER_STAGES])
def test_paged_mqa_logits_match_reference_with_either_buffering(kernel_device: str,
                                                                 num_stages: int) -> None:
    """Both builds the launcher picks between, whichever the card present would get."""
    case = GPU_PAGED[1] if kernel_device == "cuda" else INTERPRETER_PAGED[1]
    inputs = paged_inputs(case, kernel_device, seed=11)
    got = paged_mqa_logits(**inputs, clean_logits=case.clean, num_stages=num_stages,
                           keys_per_program=case.keys_per_program)
    assert_logits_match(got, paged_mqa_logits_reference(**inputs), case.clean)


@pytest.mark.parametrize("rows", [1, 5])
def test_paged_mqa_logits_cut_rows_by_the_row_count(kernel_device: str, rows: int) -> None:
    """The launcher's own keys a program (256 for one row, 512 for a few), past a row's end
    and across pages, gives the reference's logits."""
    case = PagedCase(rows, 1, 16, 32, 16, 1100, per_draft_lengths=False, clean=True)
    inputs = paged_inputs(case, kernel_device, seed=rows)
    got = paged_mqa_logits(**inputs, clean_logits=True)
    assert_logits_match(got, paged_mqa_logits_reference(**inputs), clean=True)


def keys_per_program_cases() -> list[dict]:
    data = Path(__file__).with_name("data") / "paged_logits_keys_per_program_h200_sm80.json"
    return json.loads(data.read_text())["cases"]


@pytest.mark.parametrize(
    "case", keys_per_program_cases(),
    ids=lambda case: f"{case['sms']}SMs-rows{case['rows']}-keys{case['keys']}")
def test_keys_per_program_rule_against_the_timed_cuts(case: dict) -> None:
    """Against decode steps timed at 256, 512, 1,024 and 2,048 keys a program (H200, sm80
    mode, 132, 112 and 88 SMs): the pick was timed, is never 10% slower than the 1,024 every
    step took before, and within 1.5x of the fastest (the best cut of a few rows depends on
    their lengths, which the launcher cannot read)."""
    times = {int(keys): ms for keys, ms in case["ms"].items()}
    pick = keys_per_program_for_rows(case["rows"])
    assert pick in times
    assert times[pick] <= 1.10 * times[KEYS_PER_PROGRAM]
    assert times[pick] <= 1.5 * min(times.values())


def test_keys_per_program_rule_pays_where_rows_are_few() -> None:
    """Over the timed steps of up to 8 rows, the rule's cuts take at most 0.7x the time of
    1,024 keys a program (geometric mean)."""
    ratios = [case["ms"][str(keys_per_program_for_rows(case["rows"]))]
              / case["ms"][str(KEYS_PER_PROGRAM)]
              for case in keys_per_program_cases() if case["rows"] <= 8]
    assert math.prod(ratios) ** (1 / len(ratios)) <= 0.7


def test_pipeline_stages_double_buffer_long_programs_that_keep_their_residency() -> None:
    assert pipeline_stages(8, 2, 2) == DOUBLE_BUFFER_STAGES
    assert pipeline_stages(DOUBLE_BUFFER_MIN_STEPS, 2, 2) == DOUBLE_BUFFER_STAGES
    assert pipeline_stages(DOUBLE_BUFFER_MIN_STEPS - 1, 2, 2) == SINGLE_BUFFER_STAGES
    assert pipeline_stages(8, 2, 1) == SINGLE_BUFFER_STAGES  # sm86/89's 100 KB
    assert pipeline_stages(8, 3, 2) == SINGLE_BUFFER_STAGES


def paged_logits_build(capability: int, num_stages: int) -> dict[str, int]:
    """The paged logits for DeepSeek-V4's indexer (64 heads of 128 dims, 64-token pages,
    1,024 keys a program) built for sm`capability` (`offline_build.build_for_target`)."""
    import triton.language as tl

    from services.engine.backport.kernels import paged_mqa_logits as paged

    pointers = {"q_ptr": "*u8", "cache_ptr": "*u8", "weights_ptr": "*fp32",
                "lengths_ptr": "*i32", "block_table_ptr": "*i32", "logits_ptr": "*fp32"}
    constants = dict(LENGTH_PER_ROW=False, BLOCK_SIZE=64, HEAD_DIM=128, HEADS=64,
                     KEYS_PER_PROGRAM=KEYS_PER_PROGRAM, BLOCK_N=paged.DEFAULT_BLOCK_N,
                     CLEAN=False, DOT_DTYPE=tl.bfloat16, FP8_DOT=capability >= 89,
                     FAST_DEQUANT=True)
    aligned = (*pointers, "block_stride", "stride_q_row", "stride_q_head", "stride_weights",
               "stride_block_table", "stride_logits")
    return build_for_target(paged._paged_mqa_logits_kernel, capability, pointers, constants,
                            aligned, num_warps=paged.DEFAULT_NUM_WARPS, num_stages=num_stages)


def test_paged_logits_double_buffer_fits_twice_on_sm80_only() -> None:
    """The double-buffered K tiles keep two programs an SM on an A100 (as the single
    buffer does with Triton 3.6, where it was timed) and one on sm86's 100 KB, so sm86
    cards stay single-buffered. Built without a GPU."""
    calls = [dict(capability=c, num_stages=s) for c in (80, 86)
             for s in (SINGLE_BUFFER_STAGES, DOUBLE_BUFFER_STAGES)]
    builds = build_in_child("tests.kernels.test_mqa_logits:paged_logits_build", calls)
    programs = {(call["capability"], call["num_stages"]):
                programs_an_sm(f"sm{call['capability']}", build)
                for call, build in zip(calls, builds, strict=True)}
    assert all(build["spill_bytes"] == 0 for build in builds), builds
    assert programs[(80, DOUBLE_BUFFER_STAGES)] == 2, builds
    assert programs[(86, DOUBLE_BUFFER_STAGES)] == 1, builds
    assert programs[(86, SINGLE_BUFFER_STAGES)] == 2, builds
    assert pipeline_stages(8, programs[(86, SINGLE_BUFFER_STAGES)],
                           programs[(86, DOUBLE_BUFFER_STAGES)]) == SINGLE_BUFFER_STAGES


def test_logits_refuse_mismatched_inputs(kernel_device: str) -> None:
    inputs = ragged_inputs(INTERPRETER_RAGGED[0], kernel_device, seed=9)
    with pytest.raises(TypeError, match="fp8 e4m3"):
        mqa_logits(**{**inputs, "q": inputs["q"].float()})
    with pytest.raises(ValueError, match="weights must be"):
        mqa_logits(**{**inputs, "weights": inputs["weights"][:, :3]})
    paged = paged_inputs(INTERPRETER_PAGED[0], kernel_device, seed=9)
    with pytest.raises(ValueError, match="D \\+ 4"):
        paged_mqa_logits(**{**paged, "kv_cache": paged["kv_cache"][..., :-1]})


def prefill_tiling_build(capability: int) -> dict[str, int]:
    """The default tiling for DeepSeek-V4's indexer (64 heads of 128 dims) built for
    sm`capability` (`offline_build.build_for_target`)."""
    import triton.language as tl

    from services.engine.backport.kernels import mqa_logits as logits

    pointers = {"q_ptr": "*u8", "k_ptr": "*u8", "k_scale_ptr": "*fp32", "weights_ptr": "*fp32",
                "ks_ptr": "*i32", "ke_ptr": "*i32", "logits_ptr": "*fp32"}
    constants = dict(HEAD_DIM=128, HEADS=64, TOKENS=logits.DEFAULT_TOKENS,
                     KEYS_PER_PROGRAM=logits.KEYS_PER_PROGRAM, BLOCK_N=logits.DEFAULT_BLOCK_N,
                     CLEAN=False, DOT_DTYPE=tl.bfloat16, FP8_DOT=capability >= 89,
                     FAST_DEQUANT=True)
    aligned = (*pointers, "num_heads", "stride_q_token", "stride_q_head", "stride_k",
               "stride_weights")
    return build_for_target(logits._mqa_logits_kernel, capability, pointers, constants,
                            aligned, num_warps=logits.DEFAULT_NUM_WARPS)


def test_prefill_logits_tiling_leaves_every_target_two_programs_an_sm() -> None:
    """The prefill logits' default tiling keeps two programs an SM on each target card
    (on sm86 its shared memory is within 512 B of the limit for two). Built without a GPU."""
    capabilities = (80, 86, 89)
    builds = build_in_child("tests.kernels.test_mqa_logits:prefill_tiling_build",
                            [dict(capability=c) for c in capabilities])
    for capability, build in zip(capabilities, builds, strict=True):
        assert build["spill_bytes"] == 0, (capability, build)
        assert programs_an_sm(f"sm{capability}", build) >= 2, (capability, build)
