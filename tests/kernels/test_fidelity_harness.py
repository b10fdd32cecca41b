"""The harness itself: fp8 hardware paths fail in sm80/sm86 mode, work (and agree with the
software encoder) where the arch has them, and the quantizers take them only there; fp8
torch matmuls are refused; Triton launches keep the card present to the blocks an SM the
target holds, and run on the target card's SM count."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from services.engine.backport.kernels.arch_fidelity import (
    KERNEL_SHARED_KEY,
    TARGET_REGISTERS_KEY,
    Fp8MatmulGuard,
)
from services.engine.backport.kernels.card_limits import CARD_LIMITS, resident_blocks
from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.fp8_e4m3 import encode_e4m3, hardware_fp8_encode
from services.engine.backport.kernels.k_cache_insert import (
    _quantize_insert_kernel,
    quantize_and_insert_k_cache,
)

HARDWARE_FP8_BLOCK = 1024
SQUARE_SIDE = 64  # a 64 x 64 bf16 tl.dot: its operands pass through shared memory


@triton.jit
def _hardware_fp8_cast_kernel(x_ptr, out_ptr, num_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)


def _hardware_encode(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(x.numel(), HARDWARE_FP8_BLOCK),)
    _hardware_fp8_cast_kernel[grid](x, out, x.numel(), BLOCK=HARDWARE_FP8_BLOCK)
    return out


def test_hardware_fp8_matches_arch(
    kernel_device: str, is_interpreter: bool, gpu_arch: str | None
) -> None:
    if is_interpreter:
        pytest.skip("compiles for a GPU arch")
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = every_bf16.float().to(kernel_device)
    if gpu_arch in ("sm80", "sm86"):
        # Lowered as Ampere lowers it: the fp8 cast must not compile.
        with pytest.raises(Exception, match="(?i)fp8|not supported"):
            _hardware_encode(values)
        return
    hardware = _hardware_encode(values).cpu()
    software = encode_e4m3(values).cpu()
    is_nan = torch.isnan(every_bf16.float())
    assert torch.equal(hardware[~is_nan], software[~is_nan])
    assert torch.equal(hardware[is_nan] & 0x7F, software[is_nan] & 0x7F)


def _full_mantissa_values(device: str) -> torch.Tensor:
    """fp32 values with all 24 mantissa bits, over e4m3's range and past it, and edges."""
    generator = torch.Generator().manual_seed(5)
    count = 1 << 20
    magnitudes = torch.rand(count, generator=generator) * torch.exp2(
        torch.randint(-14, 10, (count,), generator=generator).float())
    signs = torch.where(torch.rand(count, generator=generator) < 0.5, -1.0, 1.0)
    edges = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 1e30, float("inf"), -float("inf"),
                          2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 2.0**-6 - 2.0**-10])
    return torch.cat([magnitudes * signs, edges]).to(device)


def test_hardware_encode_is_exact_where_the_arch_has_it(
    kernel_device: str, is_interpreter: bool, gpu_arch: str | None
) -> None:
    """`e4m3_encode`'s sm89+ path rounds straight from fp32, byte for byte as the software
    path, where Triton's own fp8 cast (through a truncating f16) does not. Lowered for
    sm80/86 the harness refuses it, as the target's ptxas would (the H200's takes it)."""
    if is_interpreter:
        pytest.skip("compiles for a GPU arch")
    values = _full_mantissa_values(kernel_device)
    if gpu_arch in ("sm80", "sm86"):
        with pytest.raises(Exception, match="fp8 instructions not supported"):
            encode_e4m3(values, hardware=True)
        return
    assert torch.equal(encode_e4m3(values, hardware=True), encode_e4m3(values))


def test_fp8_matmul_guard_refuses_fp8_operands() -> None:
    a = torch.ones(4, 4).to(torch.float8_e4m3fn)
    with Fp8MatmulGuard():
        with pytest.raises(RuntimeError, match="fp8 torch matmul"):
            torch.matmul(a, a)
        with pytest.raises(RuntimeError, match="fp8 torch matmul"):
            torch._scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_b=torch.ones(()))
        plain = torch.ones(4, 4)
        assert torch.equal(torch.matmul(plain, plain), torch.full((4, 4), 4.0))


@triton.jit
def _square_kernel(x_ptr, out_ptr, SIDE: tl.constexpr):
    offsets = tl.arange(0, SIDE)
    tile = offsets[:, None] * SIDE + offsets[None, :]
    x = tl.load(x_ptr + tile)
    tl.store(out_ptr + tile, tl.dot(x, x))


@triton.jit
def _double_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, 2 * tl.load(x_ptr + offsets))


@pytest.mark.parametrize("uses_shared_memory", [True, False])
def test_triton_launches_hold_the_card_to_the_target_blocks(
    is_interpreter: bool, gpu_arch: str | None, uses_shared_memory: bool
) -> None:
    if is_interpreter or gpu_arch not in CARD_LIMITS:
        pytest.skip("needs a CUDA card in --gpu-arch mode")
    from services.engine.backport.kernels.cuda_module import blocks_per_sm

    x = torch.randn(SQUARE_SIDE, SQUARE_SIDE, device="cuda").to(torch.bfloat16)
    out = torch.empty(SQUARE_SIDE, SQUARE_SIDE, device="cuda")
    if uses_shared_memory:
        kernel = _square_kernel[(1,)](x, out, SIDE=SQUARE_SIDE)
        expected = x.float() @ x.float()
    else:
        kernel = _double_kernel[(SQUARE_SIDE,)](x, out, BLOCK=SQUARE_SIDE)
        expected = 2 * x.float()
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)

    metadata = kernel.metadata
    kernel_shared = getattr(metadata, KERNEL_SHARED_KEY)
    assert (kernel_shared > 0) == uses_shared_memory
    assert metadata.shared >= kernel_shared
    threads = metadata.num_warps * 32
    target = resident_blocks(gpu_arch, threads, kernel_shared,
                             getattr(metadata, TARGET_REGISTERS_KEY))
    assert blocks_per_sm(kernel.function, threads, metadata.shared) == target


@triton.jit
def _sm_id_kernel(out_ptr):
    program = tl.program_id(0)
    sm_id = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [program], dtype=tl.int32,
                                      is_pure=False, pack=1)
    tl.store(out_ptr + program, sm_id)


def test_launches_run_on_the_target_cards_sms(
    is_interpreter: bool, gpu_arch: str | None, held_sm_count: int | None
) -> None:
    """In --gpu-arch mode a launch spreads over the target card's SM count (as the driver
    rounds it), not over the whole card present."""
    if is_interpreter or gpu_arch not in CARD_LIMITS:
        pytest.skip("needs a CUDA card in --gpu-arch mode")
    card = torch.cuda.get_device_properties().multi_processor_count
    if held_sm_count is None:
        pytest.skip(f"the card's {card} SMs are not more than the target's (or --whole-card)")
    programs = 64 * card
    sm_ids = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    _sm_id_kernel[(programs,)](sm_ids, num_warps=1)
    used = torch.unique(sm_ids).numel()
    assert 0.9 * held_sm_count <= used <= held_sm_count < card


@pytest.mark.parametrize("arch, expected", [("sm80", False), ("sm86", False), ("sm89", True),
                                            ("sm90", True)])
def test_hardware_fp8_encode_follows_the_arch_lowered_for(
    monkeypatch: pytest.MonkeyPatch, arch: str, expected: bool
) -> None:
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(triton.knobs.runtime, "override_arch", arch)
    assert hardware_fp8_encode(torch.device("cuda")) is expected
    assert hardware_fp8_encode(torch.device("cpu")) is False


def test_quantizers_encode_in_hardware_only_where_the_arch_has_it(
    is_interpreter: bool, gpu_arch: str | None
) -> None:
    """sm89 mode compiles the insert with the card's fp8 conversion; sm80/86 mode without
    (lowered for those archs it would not compile at all)."""
    if is_interpreter or gpu_arch not in CARD_LIMITS:
        pytest.skip("needs a CUDA card in --gpu-arch mode")
    block_size = 64
    cache = layout.allocate_cache(1, block_size, "cuda")
    k = torch.randn(4, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    quantize_and_insert_k_cache(k, cache, torch.arange(4, device="cuda"), block_size)
    kernel_caches = [cache[0] if isinstance(cache, tuple) else cache
                     for cache in _quantize_insert_kernel.device_caches.values()]
    ptx = [kernel.asm["ptx"] for kernel_cache in kernel_caches for kernel in kernel_cache.values()]
    assert ptx
    assert any("e4m3x2" in text for text in ptx) == (gpu_arch == "sm89")
