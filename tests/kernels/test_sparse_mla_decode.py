"""Sparse MLA decode (split-K + combine) against the plain-torch reference."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.engine.backport.cpu import attention_ops
from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.sparse_mla_combine import (
    combine_splits,
    combine_splits_reference,
)
from services.engine.backport.kernels.sparse_mla_decode import (
    choose_num_splits,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)

SOFTMAX_SCALE = layout.HEAD_DIM**-0.5
WINDOW = 128  # DeepSeek-V4's sliding window: the SWA list is always this wide


@dataclass(frozen=True)
class DecodeCase:
    """One decode batch: tokens, heads, compressed top-k width, SWA width, splits."""

    num_tokens: int
    num_heads: int
    topk: int
    window: int
    num_splits: int | None = None
    with_sink: bool = True
    with_extra: bool = True


GPU_CASES = [
    DecodeCase(1, 64, 2048, WINDOW),
    DecodeCase(8, 64, 512, WINDOW),
    DecodeCase(64, 128, 2048, WINDOW),
    DecodeCase(256, 64, 512, WINDOW),
    DecodeCase(256, 16, 2048, WINDOW),  # the largest batch at the widest top-k (TP4's heads)
    DecodeCase(3, 16, 2048, WINDOW, num_splits=1),
    DecodeCase(5, 40, 300, 100, num_splits=7, with_sink=False),
    DecodeCase(4, 64, 0, WINDOW, with_extra=False),
]
INTERPRETER_CASES = [
    DecodeCase(3, 20, 48, 24, num_splits=1),
    DecodeCase(2, 16, 70, 16, num_splits=3),
    DecodeCase(2, 16, 0, 40, num_splits=2, with_sink=False, with_extra=False),
]


def filled_cache(
    num_rows: int, block_size: int, device: str, generator: torch.Generator
) -> torch.Tensor:
    num_blocks = -(-num_rows // block_size) + 1
    cache = layout.allocate_cache(num_blocks, block_size, "cpu")
    rows = torch.randn(num_blocks * block_size, layout.HEAD_DIM, generator=generator).to(
        torch.bfloat16
    )
    layout.insert_rows_reference(rows, cache, torch.arange(num_blocks * block_size), block_size)
    return cache.to(device)


def _slot_lists(
    num_tokens: int, width: int, num_slots: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random slots with -1 holes, a few all-padding rows and lengths shorter than the width."""
    slots = torch.randint(0, num_slots, (num_tokens, width), generator=generator, dtype=torch.int32)
    holes = torch.rand(num_tokens, width, generator=generator) < 0.15
    slots[holes] = -1
    lengths = torch.randint(0, width + 1, (num_tokens,), generator=generator, dtype=torch.int32)
    lengths[0] = width
    if num_tokens > 2:
        slots[-1] = -1  # a token whose whole list is padding
    return slots, lengths


def run_case(
    case: DecodeCase, device: str, seed: int, decode: Callable[..., object] = sparse_mla_decode
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(decode's (out, lse), the reference's) for one case's random inputs."""
    generator = torch.Generator().manual_seed(seed)
    window_cache = filled_cache(4 * case.window, 64, device, generator)
    window_slots, window_lengths = _slot_lists(
        case.num_tokens, case.window, 4 * case.window, generator
    )
    kwargs = {}
    if case.with_extra:
        num_compressed = max(4 * case.topk, 64)
        extra_block_size = 4 if device == "cpu" else 64
        extra_cache = filled_cache(num_compressed, extra_block_size, device, generator)
        extra_slots, extra_lengths = _slot_lists(
            case.num_tokens, case.topk, num_compressed, generator
        )
        kwargs = dict(
            extra_k_cache=extra_cache,
            extra_indices=extra_slots.to(device),
            extra_topk_length=extra_lengths.to(device),
            extra_block_size=extra_block_size,
        )
    q = torch.randn(case.num_tokens, case.num_heads, layout.HEAD_DIM, generator=generator)
    q = (q * 2).to(torch.bfloat16).to(device)
    sink = None
    if case.with_sink:
        # FlashMLA takes +-inf sinks: -inf changes nothing, +inf zeroes the head's output.
        sink = torch.randn(case.num_heads, generator=generator) * 3
        sink[0], sink[1] = float("-inf"), float("inf")
        sink = sink.to(device)
    common = dict(
        q=q,
        k_cache=window_cache,
        indices=window_slots.to(device),
        softmax_scale=SOFTMAX_SCALE,
        topk_length=window_lengths.to(device),
        attn_sink=sink,
        block_size=64,
        **kwargs,
    )
    got = decode(**common, num_splits=case.num_splits)
    want = sparse_mla_decode_reference(**common)
    return got, want


def _cases(device: str) -> list[DecodeCase]:
    return GPU_CASES if device == "cuda" else INTERPRETER_CASES


@pytest.mark.parametrize("case_index", range(len(GPU_CASES)))
def test_decode_matches_reference(kernel_device: str, case_index: int, record_max_error) -> None:
    cases = _cases(kernel_device)
    if case_index >= len(cases):
        pytest.skip("large shapes run on a CUDA card only")
    case = cases[case_index]
    got, want = run_case(case, kernel_device, seed=case_index)
    error = check_against_reference(case, got, want)
    record_max_error("_sparse_mla_decode_kernel", error)
    if case.num_splits != 1:
        record_max_error("_combine_kernel", error)


def check_against_reference(
    case: DecodeCase,
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
) -> float:
    """Asserts a decode's (out, lse) match the reference's; returns the max abs error."""
    out, lse = got[0].float().cpu(), got[1].cpu()
    want_out, want_lse = want[0].cpu(), want[1].cpu()

    assert not torch.isnan(out).any()
    error = (out - want_out).abs().max().item()
    # bf16 output and bf16 probabilities in the value dot: about 2**-8 relative.
    assert error <= 1e-2 * max(1.0, want_out.abs().max().item()), case
    assert ((out - want_out).norm() / want_out.norm().clamp(min=1e-6)).item() < 5e-3
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (out[empty.unsqueeze(-1).expand_as(out)] == 0).all()
    lse_error = (lse[~empty] - want_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert lse_error < 1e-3
    return error


def test_decode_accepts_flashmla_shapes(kernel_device: str) -> None:
    """q [T, 1, H, D] and indices [T, 1, K] as FlashMLA takes them give the same result."""
    case = INTERPRETER_CASES[0]
    generator = torch.Generator().manual_seed(3)
    cache = filled_cache(64, 16, kernel_device, generator)
    slots, lengths = _slot_lists(case.num_tokens, 32, 64, generator)
    q = torch.randn(case.num_tokens, case.num_heads, layout.HEAD_DIM, generator=generator).to(
        torch.bfloat16
    )
    q, slots, lengths = q.to(kernel_device), slots.to(kernel_device), lengths.to(kernel_device)
    flat_out, flat_lse = sparse_mla_decode(q, cache, slots, SOFTMAX_SCALE, lengths, block_size=16)
    shaped_view = cache.as_strided(
        (cache.shape[0], 16, 1, layout.BYTES_PER_TOKEN),
        (cache.stride(0), layout.BYTES_PER_TOKEN, layout.BYTES_PER_TOKEN, 1),
    )
    out, lse = sparse_mla_decode(
        q.unsqueeze(1), shaped_view, slots.unsqueeze(1), SOFTMAX_SCALE, lengths
    )
    assert torch.equal(out.cpu(), flat_out.cpu())
    assert torch.equal(lse.cpu(), flat_lse.cpu())


def test_decode_takes_int64_slot_lists(kernel_device: str) -> None:
    """int64 slots and lengths (vLLM's CPU op takes int64) give what int32 ones give, and
    other dtypes are refused. Triton 3.6 failed to compile the decode for int64 slot lists
    with an extra cache; the launcher now narrows them."""
    case = INTERPRETER_CASES[1]
    generator = torch.Generator().manual_seed(4)
    cache = filled_cache(64, 16, kernel_device, generator)
    extra_cache = filled_cache(96, 4, kernel_device, generator)
    slots, lengths = _slot_lists(case.num_tokens, 32, 64, generator)
    extra_slots, extra_lengths = _slot_lists(case.num_tokens, case.topk, 96, generator)
    q = torch.randn(case.num_tokens, case.num_heads, layout.HEAD_DIM, generator=generator)
    q = q.to(torch.bfloat16).to(kernel_device)

    def decode(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_mla_decode(
            q, cache, slots.to(kernel_device, dtype), SOFTMAX_SCALE,
            lengths.to(kernel_device, dtype), extra_k_cache=extra_cache,
            extra_indices=extra_slots.to(kernel_device, dtype),
            extra_topk_length=extra_lengths.to(kernel_device, dtype), block_size=16,
            extra_block_size=4, num_splits=2,
        )

    want_out, want_lse = decode(torch.int32)
    out, lse = decode(torch.int64)
    assert torch.equal(out.cpu(), want_out.cpu())
    assert torch.equal(lse.cpu(), want_lse.cpu())
    with pytest.raises(TypeError, match="must be int32 or int64, got torch.float32"):
        decode(torch.float32)


def test_decode_matches_the_torch_op_vllm_cpu_runs_deepseek_v4_on(kernel_device: str) -> None:
    """The same cache bytes and slot lists through `attention_ops.flash_mla_with_kvcache`,
    the torch op the backport gives vllm-cpu for its missing `flash_mla_with_kvcache_cpu`
    (vLLM's DeepSeek-V4 runs on it in tests/e2e): a second implementation of the op,
    written apart from this decode's reference. Slots are distinct within a token's list,
    as top-k lists and windows are: that op counts a repeated slot once."""
    generator = torch.Generator().manual_seed(11)
    num_tokens, num_heads, window, topk = 3, 16, 24, 40
    window_cache = filled_cache(4 * window, 64, "cpu", generator)
    compressed_cache = filled_cache(4 * topk, 16, "cpu", generator)

    def distinct_slots(width: int, num_slots: int) -> torch.Tensor:
        slots = torch.stack([torch.randperm(num_slots, generator=generator)[:width]
                             for _ in range(num_tokens)]).to(torch.int32)
        slots[torch.rand(slots.shape, generator=generator) < 0.2] = -1
        slots[-1] = -1  # a token with no key at all
        return slots

    window_slots = distinct_slots(window, 4 * window)
    compressed_slots = distinct_slots(topk, 4 * topk)
    q = (torch.randn(num_tokens, num_heads, layout.HEAD_DIM, generator=generator) * 2).to(
        torch.bfloat16)
    sink = torch.randn(num_heads, generator=generator) * 3
    out, _ = sparse_mla_decode(
        q.to(kernel_device), window_cache.to(kernel_device), window_slots.to(kernel_device),
        SOFTMAX_SCALE, None, sink.to(kernel_device), compressed_cache.to(kernel_device),
        compressed_slots.to(kernel_device), None, block_size=64, extra_block_size=16)
    want = torch.empty_like(q)
    attention_ops.flash_mla_with_kvcache(want, q, window_cache, window_slots, 64,
                                         compressed_cache, compressed_slots, 16, sink,
                                         SOFTMAX_SCALE)
    out, want = out.float().cpu(), want.float()
    assert (out[-1] == 0).all() and (want[-1] == 0).all()
    assert (out - want).abs().max().item() <= 1e-2 * max(1.0, want.abs().max().item())
    assert ((out - want).norm() / want.norm()).item() < 5e-3


@pytest.mark.parametrize("partial_dtype", [torch.float32, torch.bfloat16])
def test_combine_matches_reference(
    kernel_device: str, partial_dtype: torch.dtype, record_max_error
) -> None:
    generator = torch.Generator().manual_seed(11)
    num_tokens, num_splits, num_heads = 3, 5, 24
    partial_out = torch.randn(
        num_tokens, num_splits, num_heads, layout.HEAD_DIM, generator=generator
    ).to(partial_dtype)
    partial_lse = torch.randn(num_tokens, num_splits, num_heads, generator=generator) * 4
    partial_lse[0, 1:] = float("-inf")  # one split only
    partial_lse[1] = float("-inf")  # nothing valid at all
    partial_out[partial_lse.isinf()] = 0.0
    sink = torch.randn(num_heads, generator=generator)
    sink[0], sink[1] = float("-inf"), float("inf")
    out = torch.empty(
        num_tokens, num_heads, layout.HEAD_DIM, dtype=torch.bfloat16, device=kernel_device
    )
    lse = torch.empty(num_tokens, num_heads, device=kernel_device)
    combine_splits(
        partial_out.to(kernel_device),
        partial_lse.to(kernel_device),
        sink.to(kernel_device),
        out,
        lse,
    )
    want_out, want_lse = combine_splits_reference(partial_out.float(), partial_lse, sink)
    error = (out.float().cpu() - want_out).abs().max().item()
    record_max_error("_combine_kernel", error)
    assert error <= 1e-2 * want_out.abs().max().item()
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert torch.allclose(lse.cpu()[finite], want_lse[finite], atol=1e-5)


def split_sweep_cases(file_name: str) -> list[dict]:
    """The cases of a split sweep in tests/kernels/data (`bench/kernels.py --sweep-splits`):
    one shape on one SM count, with its graph ms at each split count timed."""
    return json.loads((Path(__file__).with_name("data") / file_name).read_text())["cases"]


def split_case_id(case: dict) -> str:
    return f"{case['sms']}SMs-B{case['batch']}-H{case['heads']}-topk{case['topk']}"


def assert_near_the_fastest(case: dict, splits: int, slack: float = 0.10) -> None:
    """`splits` was timed for this case and is within `slack` of its fastest split count."""
    times = {int(count): ms for count, ms in case["ms"].items()}
    assert splits in times, f"picked {splits} splits, measured {sorted(times)}"
    fastest = min(times, key=times.__getitem__)
    assert times[splits] <= (1 + slack) * times[fastest], (
        f"{splits} splits {times[splits]} ms, fastest {fastest} splits {times[fastest]} ms")


@pytest.mark.parametrize("case", split_sweep_cases("decode_splits_triton_h200_sm80.json"),
                         ids=split_case_id)
def test_split_rule_picks_near_the_fastest_measured_split(case: dict) -> None:
    """Against every split count timed on the H200 in sm80 mode on green contexts of 132,
    112 and 88 SMs (near the A100's 108 and the A6000's 84). The one-wave rule it replaced
    was up to 47% slower, and on 132 SMs picked a count beyond those timed."""
    programs = case["batch"] * case["heads"] // 16
    assert_near_the_fastest(
        case, choose_num_splits(programs, case["topk"], case["window"], case["sms"]))
