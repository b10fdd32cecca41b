"""The output projection's block-scaled fp8 einsum (DeepGEMM's fp8_einsum "bhr,hdr->bhd",
recipe (1, 128, 128)) against its plain-torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from services.engine.backport.kernels.fp8_einsum import (
    MIN_BLOCKS_PER_SPLIT,
    SCALE_BLOCK,
    EinsumTiling,
    dequantize_blocks,
    fp8_einsum,
    fp8_einsum_reference,
    cheapest_split_count,
    even_split_count,
    split_cost,
)
from services.engine.backport.kernels.inv_rope_fp8_quant import fused_inv_rope_fp8_quant
from tests.kernels.offline_build import build_for_target, build_in_child, programs_an_sm
from tests.kernels.test_mqa_logits import fp8_values
from tests.kernels.test_quantizers import MAX_POSITION, _cos_sin_cache


@dataclass(frozen=True)
class EinsumCase:
    num_tokens: int
    num_groups: int
    out_dim: int
    reduce_dim: int
    tiling: EinsumTiling | None = None  # None: the launcher's own


GPU_CASES = [
    EinsumCase(1, 2, 1024, 4096),  # a decode step at TP4 (16 heads, 2 groups of 8)
    EinsumCase(1, 8, 1024, 4096),  # at TP1
    EinsumCase(2, 2, 1024, 4096),  # 14 of 16 token rows padding
    EinsumCase(32, 2, 1024, 4096),
    EinsumCase(64, 8, 1024, 4096),
    EinsumCase(200, 2, 1024, 4096),  # a batch of decode steps: 128-token tiles, split
    EinsumCase(300, 2, 1024, 4096),  # a prefill chunk with a partial token block
    EinsumCase(37, 3, 200, 384),  # a partial weight scale block
]
INTERPRETER_CASES = [
    EinsumCase(3, 2, 48, 512, EinsumTiling(block_t=16, block_d=16, num_warps=4, num_stages=1,
                                           splits=3)),
    EinsumCase(20, 1, 130, 128, EinsumTiling(block_t=16, block_d=32, num_warps=4, num_stages=1)),
    EinsumCase(1, 2, 40, 512),  # one token: split, a partial row block
]


def einsum_inputs(case: EinsumCase, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x as the inverse-RoPE quant lays it out (a [T, G, R] view of a [G, T, R] buffer,
    MN-major scales), w and its block scales as a checkpoint holds them."""
    t, g, d, r = case.num_tokens, case.num_groups, case.out_dim, case.reduce_dim
    blocks = r // SCALE_BLOCK
    x = fp8_values((g, t, r), generator).transpose(0, 1)
    x_scale = torch.exp2(torch.randint(-12, 4, (g, blocks, t), generator=generator).float())
    w = fp8_values((g, d, r), generator)
    w_scale = torch.rand(g, -(-d // SCALE_BLOCK), blocks, generator=generator) * 1e-2 + 1e-4
    return x, x_scale.permute(2, 0, 1), w, w_scale


def assert_einsum_matches(got: torch.Tensor, x: torch.Tensor, x_scale: torch.Tensor,
                          w: torch.Tensor, w_scale: torch.Tensor) -> float:
    """Each output within one bf16 ulp of the fp32 reference (the interpreter's bf16 cast
    truncates), plus fp32 summation-order slack on the sum of the terms' magnitudes;
    returns the worst error relative to the largest output."""
    want = fp8_einsum_reference(x, x_scale, w, w_scale)
    magnitudes = torch.einsum("tgr,gdr->tgd", dequantize_blocks(x, x_scale, (2,)).abs(),
                              dequantize_blocks(w, w_scale, (1, 2)).abs())
    error = (got.float() - want).abs()
    assert torch.all(error <= want.abs() * 2.0**-7 + magnitudes * 1e-5), error.max()
    return error.max().item() / max(want.abs().max().item(), 1e-30)


@pytest.mark.parametrize("case_index", range(len(GPU_CASES)))
def test_fp8_einsum_matches_reference(kernel_device: str, case_index: int,
                                      record_max_error) -> None:
    cases = GPU_CASES if kernel_device == "cuda" else INTERPRETER_CASES
    if case_index >= len(cases):
        pytest.skip("large shapes run on a CUDA card only")
    case = cases[case_index]
    x, x_scale, w, w_scale = einsum_inputs(case, torch.Generator().manual_seed(case_index))
    out = torch.full((case.num_tokens, case.num_groups, case.out_dim), float("nan"),
                     dtype=torch.bfloat16, device=kernel_device)
    got = fp8_einsum(x.to(kernel_device), x_scale.to(kernel_device), w.to(kernel_device),
                     w_scale.to(kernel_device), out=out, tiling=case.tiling)
    assert got is out
    record_max_error("_fp8_einsum_kernel",
                     assert_einsum_matches(got.cpu(), x, x_scale, w, w_scale))
    # Split launches leave their arrival counts at zero and add the splits in one order:
    # a second launch gives the same bits.
    again = fp8_einsum(x.to(kernel_device), x_scale.to(kernel_device), w.to(kernel_device),
                       w_scale.to(kernel_device), tiling=case.tiling)
    assert torch.equal(again, got)


def test_fp8_einsum_after_inv_rope_quant(kernel_device: str) -> None:
    """The pair vLLM's `deep_gemm_fp8_o_proj` runs: the quant's own output layout in."""
    generator = torch.Generator().manual_seed(11)
    num_tokens, n_groups, heads_per_group, out_dim = (
        (70, 2, 8, 1024) if kernel_device == "cuda" else (5, 2, 1, 32))
    o = torch.randn(num_tokens, n_groups * heads_per_group, 512, generator=generator)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=generator)
    x, x_scale = fused_inv_rope_fp8_quant(
        o.to(torch.bfloat16).to(kernel_device), positions.to(kernel_device),
        _cos_sin_cache(kernel_device), n_groups, heads_per_group)
    w = fp8_values((n_groups, out_dim, heads_per_group * 512), generator)
    w_scale = torch.rand(n_groups, -(-out_dim // SCALE_BLOCK), heads_per_group * 4,
                         generator=generator) * 1e-2 + 1e-4
    # The default tiling: a decode step, R split over several programs a tile.
    got = fp8_einsum(x, x_scale, w.to(kernel_device), w_scale.to(kernel_device))
    assert_einsum_matches(got.cpu(), x.cpu(), x_scale.cpu(), w, w_scale)


def test_fp8_einsum_refuses_mismatched_inputs(kernel_device: str) -> None:
    case = INTERPRETER_CASES[0]
    x, x_scale, w, w_scale = (t.to(kernel_device) for t in
                              einsum_inputs(case, torch.Generator().manual_seed(3)))
    with pytest.raises(TypeError, match="fp8 e4m3"):
        fp8_einsum(x.float(), x_scale, w, w_scale)
    with pytest.raises(ValueError, match="w must be"):
        fp8_einsum(x, x_scale, w[:, :, :128], w_scale)
    with pytest.raises(ValueError, match="x_scale must be"):
        fp8_einsum(x, x_scale[:, :, :1], w, w_scale)
    with pytest.raises(ValueError, match="w_scale must be"):
        fp8_einsum(x, x_scale, w, w_scale.double())
    with pytest.raises(ValueError, match="out must be"):
        fp8_einsum(x, x_scale, w, w_scale, out=torch.empty(1, device=kernel_device))


@pytest.mark.parametrize("tiles", [1, 3, 16, 32, 100, 128, 256, 600])
@pytest.mark.parametrize(("sm_count", "programs_per_sm"), [(88, 1), (112, 2), (132, 4)])
@pytest.mark.parametrize("num_blocks", [1, 3, 7, 32, 33])
def test_split_count_is_the_cheapest(tiles: int, sm_count: int, programs_per_sm: int,
                                     num_blocks: int) -> None:
    splits = cheapest_split_count(tiles, num_blocks, sm_count, programs_per_sm)
    assert (splits - 1) * -(-num_blocks // splits) < num_blocks  # every split walks blocks
    assert splits == 1 or num_blocks // splits >= MIN_BLOCKS_PER_SPLIT
    costs = {s: split_cost(s, tiles, num_blocks, sm_count, programs_per_sm)
             for s in range(1, max(1, num_blocks // MIN_BLOCKS_PER_SPLIT) + 1)}
    assert costs[splits] == min(costs.values())
    assert all(costs[s] > costs[splits] for s in costs if s < splits)


# Counts the H200 found fastest in sm80 mode (sm86 on 88 SMs), 32 scale blocks.
@pytest.mark.parametrize(("tiles", "sm_count", "programs_per_sm", "want"), [
    (32, 132, 4, 8),  # 16 x 64 tiles at G=2 (4 programs an SM; swept with 1 token), sm89 too
    (128, 132, 4, 4),  # the same at G=8
    (128, 132, 3, 3),  # 32 tokens at G=8 (32 x 64 tiles)
    (32, 132, 2, 8),  # 64 tokens at G=2 (64 x 64 tiles)
    (128, 132, 2, 2),  # 64 tokens at G=8
    (256, 132, 2, 1),  # 128 tokens at G=8 fill the card unsplit
    (128, 112, 2, 3),  # 64 tokens at G=8 on an A100's SMs: more than one round pays
    (128, 88, 2, 4),  # 1-32 tokens at G=8 on an A6000's
])
def test_split_count_matches_the_sweep(tiles: int, sm_count: int, programs_per_sm: int,
                                       want: int) -> None:
    assert cheapest_split_count(tiles, 32, sm_count, programs_per_sm) == want


def test_even_split_count() -> None:
    # 32 blocks in 5 splits of 7 (the fifth has 4); at most 16 splits of 2 blocks; 12
    # splits would be 3 blocks each (the last 2), as 11 are.
    assert even_split_count(5, 32) == 5
    assert even_split_count(40, 32) == 16
    assert even_split_count(12, 32) == 11
    assert even_split_count(1, 32) == even_split_count(4, 1) == 1


def prefill_tiling_build(capability: int) -> dict[str, int]:
    """The 4k-token chunk's default tiling, unsplit, built for sm`capability` as
    DeepSeek-V4-Flash's `wo_a` launches it (`offline_build.build_for_target`)."""
    import triton.language as tl

    from services.engine.backport.kernels import fp8_einsum as einsum

    fp8_dot = capability >= 89
    tiling = einsum.default_tiling(4096, fp8_dot)
    pointers = {"x_ptr": "*u8", "x_scale_ptr": "*fp32", "w_ptr": "*u8", "w_scale_ptr": "*fp32",
                "out_ptr": "*bf16", "partial_ptr": "*fp32", "arrivals_ptr": "*i32"}
    # Contiguous scales: a launch specializes their unit strides as constants.
    constants = dict(stride_xs_block=1, stride_ws_block=1, BLOCK_T=tiling.block_t,
                     BLOCK_D=tiling.block_d, SPLIT_K=False, SCALE_BLOCK=einsum.SCALE_BLOCK,
                     DOT_DTYPE=tl.bfloat16, FP8_DOT=fp8_dot, FAST_DEQUANT=True)
    aligned = (*pointers, "out_dim", "stride_x_token", "stride_x_group", "stride_w_group",
               "stride_w_row", "stride_out_token", "stride_out_group")
    return build_for_target(einsum._fp8_einsum_kernel, capability, pointers, constants,
                            aligned, num_warps=tiling.num_warps, num_stages=tiling.num_stages)


def test_prefill_tiling_leaves_every_target_two_programs_an_sm() -> None:
    """The 128 x 64 tiles (64 x 64 with sm89's fp8 dots) keep two programs an SM on each
    target card, by shared memory (49,664 B of sm86's 50,176 for two) and by registers
    (255 a thread on sm_80, whose few spills sit outside the R loop). Built without a GPU."""
    capabilities = (80, 86, 89)
    builds = build_in_child("tests.kernels.test_fp8_einsum:prefill_tiling_build",
                            [dict(capability=c) for c in capabilities])
    for capability, build in zip(capabilities, builds, strict=True):
        assert programs_an_sm(f"sm{capability}", build) >= 2, (capability, build)
