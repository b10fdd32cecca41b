"""Sparse MLA prefill (FlashMLA's `flash_mla_sparse_fwd`) against the plain-torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.sparse_mla_prefill import (
    sparse_mla_prefill,
    sparse_mla_prefill_reference,
)
from tests.kernels.offline_build import build_for_target, build_in_child, programs_an_sm

SM_SCALE = layout.HEAD_DIM**-0.5


@dataclass(frozen=True)
class PrefillCase:
    """One prefill chunk: query tokens, heads, list width, gathered rows."""

    num_tokens: int
    num_heads: int
    topk: int
    num_kv_rows: int
    with_sink: bool = True
    with_lengths: bool = True
    block_n: int = 32


GPU_CASES = [
    PrefillCase(256, 64, 512 + 128, 4096),  # C4A: top-k 512 + the window, 64 padded heads
    PrefillCase(128, 16, 2048 + 128, 20000),  # top-k 2048 at TP4's 16 heads
    PrefillCase(64, 128, 128, 300, with_sink=False),  # a window-only layer, 128 heads
    PrefillCase(37, 40, 300, 1000, with_lengths=False),  # heads and widths off the tiles
    PrefillCase(32, 16, 640, 4096, block_n=64),
]
INTERPRETER_CASES = [
    PrefillCase(3, 20, 40, 100),
    PrefillCase(4, 16, 70, 64, with_sink=False, block_n=16),
    PrefillCase(3, 16, 24, 50, with_lengths=False),
]


def case_inputs(case: PrefillCase, device: str, seed: int) -> dict[str, object]:
    """Random q and rows; row lists with -1 holes, rows past the buffer, lengths shorter
    than the list, a token with nothing valid, and sinks of +-inf on two heads."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(case.num_kv_rows, 1, layout.HEAD_DIM, generator=generator)
    q = torch.randn(case.num_tokens, case.num_heads, layout.HEAD_DIM, generator=generator) * 2
    rows = torch.randint(0, case.num_kv_rows, (case.num_tokens, 1, case.topk),
                         generator=generator, dtype=torch.int32)
    rows[torch.rand(rows.shape, generator=generator) < 0.15] = -1
    rows[torch.rand(rows.shape, generator=generator) < 0.05] = case.num_kv_rows + 7
    rows[-1] = -1
    inputs: dict[str, object] = dict(q=q.to(torch.bfloat16), kv=kv.to(torch.bfloat16),
                                     indices=rows, sm_scale=SM_SCALE)
    if case.with_lengths:
        lengths = torch.randint(0, case.topk + 1, (case.num_tokens,), generator=generator,
                                dtype=torch.int32)
        lengths[0] = case.topk
        inputs["topk_length"] = lengths
    if case.with_sink:
        sink = torch.randn(case.num_heads, generator=generator) * 3
        sink[0], sink[1] = float("-inf"), float("inf")
        inputs["attn_sink"] = sink
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()}


def check_against_reference(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]
                            ) -> float:
    """Asserts (out, max_logits, lse) match the reference's; returns out's max abs error."""
    out, max_logits, lse = (x.float().cpu() for x in got)
    want_out, want_max, want_lse = (x.cpu() for x in want)
    assert not torch.isnan(out).any()
    error = (out - want_out).abs().max().item()
    # bf16 output and bf16 probabilities in the value dot: about 2**-8 relative.
    assert error <= 1e-2 * max(1.0, want_out.abs().max().item())
    assert ((out - want_out).norm() / want_out.norm().clamp(min=1e-6)).item() < 5e-3
    lonely = torch.isinf(want_lse)
    assert torch.equal(lse == float("inf"), lonely)
    assert (out[lonely.unsqueeze(-1).expand_as(out)] == 0).all()
    assert torch.equal(max_logits == float("-inf"), lonely)
    assert (lse[~lonely] - want_lse[~lonely]).abs().max().item() < 1e-3
    assert (max_logits[~lonely] - want_max[~lonely]).abs().max().item() < 1e-3
    return error


@pytest.mark.parametrize("case_index", range(len(GPU_CASES)))
def test_prefill_matches_reference(kernel_device: str, case_index: int, record_max_error) -> None:
    cases = GPU_CASES if kernel_device == "cuda" else INTERPRETER_CASES
    if case_index >= len(cases):
        pytest.skip("large shapes run on a CUDA card only")
    case = cases[case_index]
    inputs = case_inputs(case, kernel_device, seed=case_index)
    got = sparse_mla_prefill(**inputs, block_n=case.block_n)
    want = sparse_mla_prefill_reference(**inputs)
    record_max_error("_sparse_mla_prefill_kernel", check_against_reference(got, want))


def test_prefill_writes_into_out_as_vllm_passes_it(kernel_device: str) -> None:
    """vLLM hands FlashMLA a slice of its output buffer as `out`, and the row lists as
    [S_q, 1, K] int32 views; the result lands there and nowhere else."""
    case = INTERPRETER_CASES[0]
    inputs = case_inputs(case, kernel_device, seed=5)
    buffer = torch.full((case.num_tokens + 2, case.num_heads, layout.HEAD_DIM), 7.0,
                        dtype=torch.bfloat16, device=kernel_device)
    out, _, _ = sparse_mla_prefill(**inputs, out=buffer[1:-1])
    assert out.data_ptr() == buffer[1:-1].data_ptr()
    assert (buffer[0] == 7).all() and (buffer[-1] == 7).all()
    want, _, _ = sparse_mla_prefill(**inputs)
    assert torch.equal(buffer[1:-1].cpu(), want.cpu())


def test_prefill_refuses_what_it_cannot_run(kernel_device: str) -> None:
    inputs = case_inputs(INTERPRETER_CASES[0], kernel_device, seed=6)
    with pytest.raises(ValueError, match="d_v must be 512"):
        sparse_mla_prefill(**inputs, d_v=448)
    two_heads = inputs["kv"].expand(-1, 2, -1)
    with pytest.raises(ValueError, match="one KV head"):
        sparse_mla_prefill(**{**inputs, "kv": two_heads})
    with pytest.raises(TypeError, match="int32 or int64"):
        sparse_mla_prefill(**{**inputs, "indices": inputs["indices"].float()})


# What the launcher's arguments are, as a compile without a GPU needs them spelled out;
# a launch specializes pointers and these integers as multiples of 16.
_POINTER_TYPES = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16",
                  "indices_ptr": "*i32", "lengths_ptr": "*i32", "sink_ptr": "*fp32",
                  "max_logits_ptr": "*fp32", "lse_ptr": "*fp32"}
_MULTIPLES_OF_16 = ("list_width", "num_heads", "num_kv_rows", "stride_q_token",
                    "stride_q_head", "stride_kv_row", "stride_indices_token",
                    "stride_out_token", "stride_out_head")


def default_tiling_build(capability: int, with_lengths: bool) -> dict[str, int]:
    """The default tiling built for sm`capability` (`offline_build.build_for_target`)."""
    import triton.language as tl

    from services.engine.backport.kernels import sparse_mla_prefill as prefill

    constants = dict(HAS_LENGTHS=with_lengths, HAS_SINK=True,
                     HEADS_PER_PROGRAM=prefill.DEFAULT_HEADS_PER_PROGRAM,
                     BLOCK_N=prefill.DEFAULT_BLOCK_N, DOT_DTYPE=tl.bfloat16,
                     NUM_STAGES=prefill.DEFAULT_NUM_STAGES)
    return build_for_target(prefill._sparse_mla_prefill_kernel, capability,
                            {**_POINTER_TYPES, "qk_scale_log2": "fp32"}, constants,
                            (*_POINTER_TYPES, *_MULTIPLES_OF_16),
                            num_warps=prefill.DEFAULT_NUM_WARPS,
                            num_stages=prefill.DEFAULT_NUM_STAGES)


@pytest.mark.parametrize("with_lengths", [False, True])
def test_default_tiling_leaves_every_target_two_programs_an_sm(with_lengths: bool) -> None:
    """The default tiling's shared memory sits at sm86/89's limit for two programs an SM
    (50,176 B); at 128 B more those cards ran one, and the prefill took twice as long.
    On sm80 its registers (about 180 from sm_80's ptxas) allow two. Built without a GPU."""
    capabilities = (80, 86, 89)
    builds = build_in_child("tests.kernels.test_sparse_mla_prefill:default_tiling_build",
                            [dict(capability=c, with_lengths=with_lengths) for c in capabilities])
    for capability, build in zip(capabilities, builds, strict=True):
        assert build["spill_bytes"] == 0, build
        assert programs_an_sm(f"sm{capability}", build) == 2, (capability, build)
