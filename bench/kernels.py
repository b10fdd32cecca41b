"""Kernel benchmarks on a CUDA card, compiled as an sm80 (or sm86/sm89) card would run them.

    python bench/kernels.py --gpu-arch sm80 [--out bench-kernels.json] [--quick]

Prints one table: each kernel's median time (triton.testing.do_bench, L2 flushed before
every run, launch overhead included) and its median CUDA-graph replay (GPU time, which the
rates use), the bytes it must move (each input read once, each output written once) over
that time, that rate as a share of the copy bandwidth measured at the start of the same
run, and for the decode its tensor-core rate. The quantizers and gathers run on inputs
several times the 60 MB L2, so replays without a flush read them from memory too.
`--profile-decode [HEADS]` only launches one large decode, for Nsight Compute; `--sweep-decode`
only times the decode's tiling choices (keys per step, warps, splits; for the CUDA decode
the build's blocks an SM, stages and splits) on four shapes; `--decode-backend cuda`
points both at the CUDA decode.
`--sweep-splits` only times a decode (`--decode-backend`) at every split count beside its
rule's pick.
`--sms N` runs any of them on a green context of N SMs (the A100's 108, the A6000's 84; the
H200 rounds them up to 112 and 88), so grids meet about the target card's SM count; clocks,
caches and bandwidth stay the H200's.
`--compare-decode` only times the CUDA decode against the Triton one (the baseline), side by
side on the same inputs, beside what one device copy of the same bytes gets of the copy
bandwidth (the ceiling for any single kernel at that size). The main table has a row for each.
`--prefill` only times the sparse prefill, Triton and CUDA side by side (and their
tilings unless `--quick`), `--indexer` only the indexer's logits; both are compute-bound
and printed in TFLOP/s beside a cuBLAS bf16 matmul of the same flops in the same run (the
decode logits beside the copy bandwidth too). `--einsum` only times the output projection's fp8 einsum: decode steps
against the copy bandwidth, a prefill chunk against cuBLAS's bf16 bmm. The full run ends
with the prefill, indexer and einsum tables.

Sparse MLA decode: batch 1/8/64, top-k 512/2048 compressed rows plus the 128-row
sliding window, contexts 8k/32k/128k tokens (the compressed cache holds context/4 rows
per sequence, the indexer's C4A ratio; each token's top-k rows are distinct), 16 and
64 query heads (16 = DeepSeek-V4-Flash's 64 heads at TP4, the Ampere deployment).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import itertools
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SWA_WINDOW = 128
COMPRESS_RATIO = 4
BLOCK_SIZE = 64
COPY_BYTES = 2 << 30  # 2 GiB copied: far past the 60 MB L2
# Cold calls cycle through this many bytes of inputs (the einsum's decode steps a copy of
# the weight each, as a model's layers do), so each reads from memory, not the 60 MB L2.
COLD_BYTES = 256 << 20


def bench_ms(fn: Callable[[], object]) -> float:
    """Median ms of eager calls, L2 flushed before each: host launch overhead included."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_graph_ms(fn: Callable[[], object]) -> float:
    """Median ms of CUDA-graph replays (as vLLM runs decode): GPU time, no L2 flush."""
    import triton

    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def copy_bandwidth() -> float:
    """Device-to-device copy rate, bytes read + bytes written per second."""
    src = torch.randint(0, 255, (COPY_BYTES,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3)


def copy_share(moved: int, bandwidth: float, cold: bool = False) -> float:
    """What one device copy moving `moved` bytes (read + written) gets of `bandwidth`, by
    graph replay as the decodes are timed: the most any single kernel moving a call's bytes
    could get, its launch and ramp included. `cold`: each copy reads another source, as the
    einsum's calls each read another weight, so the bytes come from memory, not the L2."""
    sources = max(1, COLD_BYTES // (moved // 2)) if cold else 1
    srcs = [torch.empty(moved // 2, dtype=torch.uint8, device="cuda") for _ in range(sources)]
    dst = torch.empty_like(srcs[0])

    def run() -> None:
        for src in srcs:
            dst.copy_(src)

    return moved / (bench_graph_ms(run) / sources * 1e-3) / bandwidth


def filled_cache(num_rows: int) -> torch.Tensor:
    from services.engine.backport.kernels import ds_mla_cache as layout
    from services.engine.backport.kernels.k_cache_insert import quantize_and_insert_k_cache

    num_blocks = -(-num_rows // BLOCK_SIZE)
    cache = layout.allocate_cache(num_blocks, BLOCK_SIZE, "cuda")
    chunk = 1 << 20
    for start in range(0, num_blocks * BLOCK_SIZE, chunk):
        count = min(chunk, num_blocks * BLOCK_SIZE - start)
        k = torch.randn(count, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        quantize_and_insert_k_cache(
            k, cache, torch.arange(start, start + count, device="cuda"), BLOCK_SIZE
        )
    return cache


def decode_function(backend: str, cuda_arch: str | None) -> Callable[..., object]:
    """The Triton decode (sparse_mla_decode.py) for "triton", the CUDA one built for
    `cuda_arch` (None: the card's own) for "cuda"."""
    from services.engine.backport.kernels.sparse_mla_decode import sparse_mla_decode
    from services.engine.backport.kernels.sparse_mla_decode_cuda import sparse_mla_decode_cuda

    if backend == "cuda":
        return functools.partial(sparse_mla_decode_cuda, arch=cuda_arch)
    return sparse_mla_decode


def decode_inputs(
    batch: int,
    topk: int,
    context: int,
    heads: int,
    cache: torch.Tensor,
    swa_cache: torch.Tensor,
    backend: str = "triton",
    cuda_arch: str | None = None,
    **config: int | None,
) -> tuple[Callable[[], object], int]:
    """One decode shape's call with `decode_function(backend, cuda_arch)`, and the bytes it
    must move."""
    from services.engine.backport.kernels import ds_mla_cache as layout

    decode = decode_function(backend, cuda_arch)

    rows_per_seq = context // COMPRESS_RATIO
    # Sequence b owns compressed rows [b * rows_per_seq, (b + 1) * rows_per_seq).
    picks = torch.stack([torch.randperm(rows_per_seq, device="cuda")[:topk] for _ in range(batch)])
    indices = (picks + torch.arange(batch, device="cuda").unsqueeze(1) * rows_per_seq).to(
        torch.int32
    )
    lengths = torch.full((batch,), topk, dtype=torch.int32, device="cuda")
    swa_start = torch.arange(batch, device="cuda").unsqueeze(1) * SWA_WINDOW
    swa_indices = (swa_start + torch.arange(SWA_WINDOW, device="cuda")).to(torch.int32)
    swa_lengths = torch.full((batch,), SWA_WINDOW, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(heads, device="cuda")
    out = torch.empty_like(q)

    def run() -> object:
        return decode(
            q,
            swa_cache,
            swa_indices,
            layout.HEAD_DIM**-0.5,
            swa_lengths,
            sink,
            cache,
            indices,
            lengths,
            block_size=BLOCK_SIZE,
            extra_block_size=BLOCK_SIZE,
            out=out,
            **config,
        )

    rows = batch * (topk + SWA_WINDOW)
    return run, rows * (layout.BYTES_PER_TOKEN + 4) + 2 * q.numel() * 2


def decode_case(
    batch: int,
    topk: int,
    context: int,
    heads: int,
    cache: torch.Tensor,
    swa_cache: torch.Tensor,
    bandwidth: float,
    backend: str = "triton",
    cuda_arch: str | None = None,
    **config: int | None,
) -> dict[str, object]:
    """One decode shape with `decode_function(backend, cuda_arch)`."""
    from services.engine.backport.kernels import (
        sparse_mla_combine,
    )
    from services.engine.backport.kernels import (
        sparse_mla_decode as decode_module,
    )
    from services.engine.backport.kernels import ds_mla_cache as layout
    from services.engine.backport.kernels.arch_fidelity import compiled_kernel_reports

    run, moved = decode_inputs(batch, topk, context, heads, cache, swa_cache, backend,
                               cuda_arch, **config)
    before = set(compiled_kernel_reports([decode_module, sparse_mla_combine]))
    ms = bench_ms(run)
    graph_ms = bench_graph_ms(run)
    compiled = [
        r for r in compiled_kernel_reports([decode_module, sparse_mla_combine]) if r not in before
    ]
    flops = 4 * batch * heads * (topk + SWA_WINDOW) * layout.HEAD_DIM
    return {
        "kernel": "sparse_mla_decode" if backend == "triton" else "sparse_mla_decode (CUDA)",
        "shape": f"B={batch} H={heads} topk={topk}+{SWA_WINDOW} ctx={context // 1024}k",
        "config": ",".join(f"{k}={v}" for k, v in config.items()) or "default",
        "ms": ms,
        "graph ms": graph_ms,
        "bytes": moved,
        "GB/s": moved / graph_ms * 1e-6,
        "of copy": moved / (graph_ms * 1e-3) / bandwidth,
        "TFLOP/s": flops / graph_ms * 1e-9,
        "new variants": "; ".join(
            f"{r.name} {r.shared_bytes} B {r.registers} regs {r.spills} spills"
            f" ({r.card_spills} in the timed build)" for r in compiled
        ),
    }


def profile_decode(heads: int, backend: str, cuda_arch: str | None) -> None:
    """Three launches of one large decode (batch 64, top-k 2048), nothing else, so a
    profiler sees only it."""
    from services.engine.backport.kernels import ds_mla_cache as layout

    decode = decode_function(backend, cuda_arch)

    batch, topk, rows_per_seq = 64, 2048, 32768 // COMPRESS_RATIO
    cache = filled_cache(batch * rows_per_seq)
    swa_cache = filled_cache(batch * SWA_WINDOW)
    picks = torch.stack([torch.randperm(rows_per_seq, device="cuda")[:topk] for _ in range(batch)])
    indices = (picks + torch.arange(batch, device="cuda").unsqueeze(1) * rows_per_seq).to(
        torch.int32
    )
    swa = torch.arange(batch, device="cuda").unsqueeze(1) * SWA_WINDOW + torch.arange(
        SWA_WINDOW, device="cuda"
    )
    q = torch.randn(batch, heads, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        decode(
            q,
            swa_cache,
            swa.to(torch.int32),
            layout.HEAD_DIM**-0.5,
            None,
            torch.zeros(heads, device="cuda"),
            cache,
            indices,
            None,
            block_size=BLOCK_SIZE,
            extra_block_size=BLOCK_SIZE,
        )
    torch.cuda.synchronize()


def compare_decode(bandwidth: float, cuda_arch: str | None) -> None:
    """The CUDA decode against the Triton one (the baseline) on the same inputs."""
    context = 32768
    cache = filled_cache(64 * context // COMPRESS_RATIO)
    swa_cache = filled_cache(64 * SWA_WINDOW)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; graph-replay ms, context {context // 1024}k")
    from services.engine.backport.kernels.cuda_module import device_arch
    from services.engine.backport.kernels.sparse_mla_decode_cuda import load_decode

    arch = cuda_arch or device_arch(torch.device("cuda"))
    loaded = load_decode(arch, torch.cuda.current_device())
    print(f"CUDA decode for {arch}: {loaded.blocks_per_sm} blocks an SM of {loaded.sm_count}, "
          f"{loaded.kernel.resources.registers} registers")
    print("| shape | Triton ms | CUDA ms | Triton / CUDA | CUDA of copy | a copy of its bytes |")
    print("|---|---|---|---|---|---|")
    for heads in (16, 64):
        for batch in (1, 8, 64):
            for topk in (512, 2048):
                base = decode_case(batch, topk, context, heads, cache, swa_cache, bandwidth)
                cuda = decode_case(batch, topk, context, heads, cache, swa_cache, bandwidth,
                                   "cuda", cuda_arch=cuda_arch)
                print(f"| {cuda['shape']} | {base['graph ms']:.4f} | {cuda['graph ms']:.4f} | "
                      f"{base['graph ms'] / cuda['graph ms']:.2f} | {cuda['of copy']:.0%} | "
                      f"{copy_share(cuda['bytes'], bandwidth):.0%} |", flush=True)


def sweep_decode(bandwidth: float, backend: str, cuda_arch: str | None) -> None:
    """Decode tiling choices on the shapes the goal is about (batch >= 8, 16 or 64 heads)."""
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    context = 32768
    cache = filled_cache(64 * context // COMPRESS_RATIO)
    swa_cache = filled_cache(64 * SWA_WINDOW)
    rows: list[dict[str, object]] = []
    configs: list[dict[str, int | str | None]] = [
        {},
        {"num_splits": 1},
        {"num_splits": 2},
        {"num_splits": 4},
        {"num_splits": 8},
        {"num_splits": 16},
        {"num_splits": 32},
        {"num_splits": 64},
        {"block_n": 16},
        {"num_warps": 8},
        {"block_n": 64, "num_warps": 8},
    ]
    if backend == "cuda":  # the build's blocks an SM, rows in flight (stages), splits
        configs = [
            {"min_blocks": min_blocks, "stages": stages, "num_splits": splits,
             "cuda_arch": cuda_arch}
            for min_blocks in (2, 3)
            for stages in (2, 3)
            for splits in (None, 4, 8, 16)
        ]
    for batch, heads in ((64, 16), (8, 16), (1, 16), (64, 64)):
        for config in configs:
            try:
                rows.append(
                    decode_case(
                        batch, 2048, context, heads, cache, swa_cache, bandwidth, backend,
                        **config,
                    )
                )
            except Exception as error:  # noqa: BLE001 - over the card's limits is a result
                print(f"{batch=} {heads=} {config} failed: {str(error)[-300:]}", flush=True)
                continue
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)


# Shapes of the split sweep: grids of 1 to 256 (token, head block) pairs.
SPLIT_SWEEP_SHAPES = ((16, 1, 2048), (16, 1, 512), (16, 8, 2048), (16, 8, 512), (16, 32, 2048),
                      (16, 64, 2048), (16, 64, 512), (16, 128, 2048), (16, 256, 2048),
                      (64, 8, 2048), (64, 64, 2048), (64, 64, 512))


def swept_split_counts(backend: str, programs: int) -> list[int]:
    """Split counts the sweep times: 1..32 for grids of up to 16 blocks (and the Triton
    decode's larger counts, up to its 64), 1..12 above."""
    if programs > 16:
        return list(range(1, 13))
    return list(range(1, 33)) + ([40, 48, 56, 64] if backend == "triton" else [])


def sweep_splits(backend: str, cuda_arch: str | None, out: str | None) -> None:
    """Graph ms of a decode at every split count (`swept_split_counts`) beside its split
    rule's pick: the data the rules are fitted to (tests/kernels/data/decode_splits_h200_*.json
    gather the cases of three runs)."""
    from services.engine.backport.kernels import sparse_mla_decode as triton_decode
    from services.engine.backport.kernels import sparse_mla_decode_cuda as cuda_decode
    from services.engine.backport.kernels.cuda_module import device_arch

    context = 32768
    batches = max(batch for _, batch, _ in SPLIT_SWEEP_SHAPES)
    cache = filled_cache(batches * context // COMPRESS_RATIO)
    swa_cache = filled_cache(batches * SWA_WINDOW)
    device = torch.device("cuda", torch.cuda.current_device())
    if backend == "cuda":
        loaded = cuda_decode.load_decode(cuda_arch or device_arch(device), device.index)
        sm_count, blocks_per_sm = loaded.sm_count, loaded.blocks_per_sm

        def rule(programs: int, topk: int) -> int:
            return cuda_decode.choose_num_splits(programs, topk, SWA_WINDOW, loaded)
    else:
        sm_count = triton_decode.device_sm_count(device)
        blocks_per_sm = triton_decode.PROGRAMS_PER_SM

        def rule(programs: int, topk: int) -> int:
            return triton_decode.choose_num_splits(programs, topk, SWA_WINDOW, sm_count)
    print(f"{backend} decode: {sm_count} SMs, {blocks_per_sm} blocks an SM; "
          "graph ms by split count")
    cases = []
    for heads, batch, topk in SPLIT_SWEEP_SHAPES:
        programs = batch * heads // 16
        times = {}
        for splits in swept_split_counts(backend, programs):
            run, _ = decode_inputs(batch, topk, context, heads, cache, swa_cache, backend,
                                   cuda_arch, num_splits=splits)
            times[splits] = round(bench_graph_ms(run), 5)
        picked = rule(programs, topk)
        fastest = min(times, key=times.__getitem__)
        print(f"B={batch} H={heads} top-k {topk}+{SWA_WINDOW}: rule {picked} splits "
              f"{times.get(picked, float('nan')):.4f} ms, fastest {fastest} {times[fastest]:.4f} | "
              + " ".join(f"{k}:{v:.4f}" for k, v in times.items()), flush=True)
        cases.append({"sms": sm_count, "batch": batch, "heads": heads, "topk": topk,
                      "window": SWA_WINDOW, "ms": times})
    if out:
        Path(out).write_text(json.dumps(cases))


def use_sms(count: int) -> object:
    """Runs what follows on a green context of `count` of the card's SMs (the A100's 108,
    the A6000's 84; the driver may round up): the kernels, the decodes' split rules and the
    copy baseline. Returns the share, which must stay referenced."""
    from services.engine.backport.kernels.arch_fidelity import hold_sm_count

    share = hold_sm_count(count)
    print(f"green context: {share.sm_count} SMs of {share.card_sm_count}", flush=True)
    return share


def quantizer_cases(bandwidth: float, quick: bool) -> list[dict[str, object]]:
    from services.engine.backport.kernels import ds_mla_cache as layout
    from services.engine.backport.kernels.indexer_k_compress import indexer_k_compress_insert
    from services.engine.backport.kernels.indexer_q_quant import fused_indexer_q_rope_quant
    from services.engine.backport.kernels.inv_rope_fp8_quant import fused_inv_rope_fp8_quant
    from services.engine.backport.kernels.k_cache_gather import dequantize_and_gather_k_cache
    from services.engine.backport.kernels.k_cache_insert import quantize_and_insert_k_cache
    from services.engine.backport.kernels.kv_compress_insert import kv_compress_insert

    # Eager times of these small launches were mostly the host's launch cost and moved
    # between calls (the K gather at 4k tokens a request: 0.012-0.033 ms eager, 0.0063 ms
    # replayed), so rates come from graph replays of inputs past the L2.
    tokens = 16384 if quick else 262144
    results = []

    def record(name: str, shape: str, fn: Callable[[], object], moved: int) -> None:
        ms = bench_ms(fn)
        graph_ms = bench_graph_ms(fn)
        results.append(
            {
                "kernel": name,
                "shape": shape,
                "config": "default",
                "ms": ms,
                "graph ms": graph_ms,
                "GB/s": moved / graph_ms * 1e-6,
                "of copy": moved / (graph_ms * 1e-3) / bandwidth,
                "TFLOP/s": None,
            }
        )

    k = torch.randn(tokens, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cache = layout.allocate_cache(-(-tokens // BLOCK_SIZE), BLOCK_SIZE, "cuda")
    slots = torch.randperm(tokens, device="cuda")
    record(
        "quantize_and_insert_k_cache",
        f"T={tokens}",
        lambda: quantize_and_insert_k_cache(k, cache, slots, BLOCK_SIZE),
        tokens * (1024 + layout.BYTES_PER_TOKEN + 8),
    )

    requests = 8
    seq_len = tokens // requests
    out = torch.empty(requests, seq_len, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((requests,), seq_len, dtype=torch.int32, device="cuda")
    table = torch.randperm(cache.shape[0], device="cuda").view(requests, -1).to(torch.int32)
    record(
        "dequantize_and_gather_k_cache",
        f"R={requests} len={seq_len}",
        lambda: dequantize_and_gather_k_cache(out, cache, seq_lens, None, table, BLOCK_SIZE, 0),
        tokens * (layout.BYTES_PER_TOKEN + 1024),
    )

    del k, cache, out
    # The per-head kernels move about 400 B (indexer q) and 1.5 KB (output) a token and head.
    q_tokens = tokens // 16
    positions = torch.randint(0, 65536, (q_tokens,), device="cuda")
    cos_sin = torch.randn(65536, 64, device="cuda")
    index_q = torch.randn(q_tokens, 64, 128, device="cuda", dtype=torch.bfloat16)
    weights = torch.randn(q_tokens, 64, device="cuda", dtype=torch.bfloat16)
    record(
        "fused_indexer_q_rope_quant",
        f"T={q_tokens} H=64 D=128",
        lambda: fused_indexer_q_rope_quant(positions, index_q, cos_sin, weights, 0.1, 0.125),
        q_tokens * 64 * (256 + 128 + 2 + 4) + q_tokens * 256,
    )

    o_tokens = tokens // 64
    o = torch.randn(o_tokens, 64, 512, device="cuda", dtype=torch.bfloat16)
    record(
        "fused_inv_rope_fp8_quant",
        f"T={o_tokens} H=64 G=8",
        lambda: fused_inv_rope_fp8_quant(o, positions[:o_tokens], cos_sin, 8, 8),
        o_tokens * 64 * (1024 + 512 + 16) + o_tokens * 256,
    )

    del index_q, o
    state_block, overlap_width = 4, 2 * 128
    tokens //= 2  # 2 KB of fp32 state a token
    cos_sin = torch.randn(tokens, 64, device="cuda")  # its positions run up to `tokens`
    state = torch.randn(tokens // state_block + 1, state_block, 2 * overlap_width, device="cuda")
    state_table = torch.arange(state.shape[0], device="cuda", dtype=torch.int32).view(1, -1)
    seq_positions = torch.arange(tokens, device="cuda")
    kv_slots = torch.where((seq_positions + 1) % 4 == 0, seq_positions // 4, -1)
    index_cache = torch.zeros(
        tokens // 4 // 64 + 1, 64 * 132 + 576, dtype=torch.uint8, device="cuda"
    )
    index_cache = index_cache.as_strided(
        (index_cache.shape[0], 64, 132), (index_cache.stride(0), 132, 1)
    )
    norm_weight = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    request_ids = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    record(
        "indexer_k_compress_insert",
        f"T={tokens} ratio=4",
        lambda: indexer_k_compress_insert(
            state,
            request_ids,
            seq_positions,
            seq_positions,
            state_table,
            cos_sin,
            index_cache,
            kv_slots,
            norm_weight,
            1e-6,
            4,
        ),
        tokens * 2 * overlap_width * 4 + tokens // 4 * 132,
    )

    del state, index_cache
    # The attention compressor's state rows are 8 KB (ratio 4, two 512-dim sets) or 4 KB
    # (ratio 128); every row is read once, each closing token writes one 584-byte row.
    # Beside the long sequence, an 8k-token prefill chunk (vLLM's default chunk).
    norm_weight = torch.ones(layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for kv_tokens, ratio in ((tokens // 4, 4), (tokens // 4, 128), (8192, 128)):
        width = layout.HEAD_DIM * (1 + (ratio == 4))
        state = torch.randn(
            kv_tokens // state_block + 1, state_block, 2 * width, device="cuda"
        )
        state_table = torch.arange(state.shape[0], device="cuda", dtype=torch.int32).view(1, -1)
        seq_positions = torch.arange(kv_tokens, device="cuda")
        kv_slots = torch.where((seq_positions + 1) % ratio == 0, seq_positions // ratio, -1)
        kv_cache = layout.allocate_cache(kv_tokens // ratio // BLOCK_SIZE + 1, BLOCK_SIZE, "cuda")
        record(
            "kv_compress_insert",
            f"T={kv_tokens} ratio={ratio}",
            lambda: kv_compress_insert(
                state,
                request_ids,
                seq_positions,
                seq_positions,
                state_table,
                cos_sin,
                kv_cache,
                kv_slots,
                norm_weight,
                1e-6,
                ratio,
                BLOCK_SIZE,
            ),
            kv_tokens * 2 * width * 4 + kv_tokens // ratio * layout.BYTES_PER_TOKEN,
        )
        del state, kv_cache

    # A decode step: one token for each of 64 requests whose state rows sit in 4-row blocks
    # scattered over 4k-token contexts; `closing` of them end a window.
    requests, context = 64, 4096
    for ratio, closing in ((4, 16), (128, 1), (128, 8), (128, 64)):
        width = layout.HEAD_DIM * (1 + (ratio == 4))
        blocks = context // state_block
        state = torch.randn(requests * blocks, state_block, 2 * width, device="cuda")
        state_table = torch.randperm(requests * blocks, device="cuda").to(torch.int32)
        ends = torch.arange(requests, device="cuda") < closing
        step_positions = torch.where(ends, context - 1, context - 2)
        step_requests = torch.arange(requests, dtype=torch.int32, device="cuda")
        step_slots = torch.arange(requests, device="cuda")  # tensors made outside the timed call
        kv_cache = layout.allocate_cache(2, BLOCK_SIZE, "cuda")
        record(
            "kv_compress_insert",
            f"decode B={requests} ratio={ratio} closing={closing}",
            lambda: kv_compress_insert(
                state,
                step_requests,
                step_positions,
                step_positions,
                state_table.view(requests, blocks),
                cos_sin,
                kv_cache,
                step_slots,
                norm_weight,
                1e-6,
                ratio,
                BLOCK_SIZE,
            ),
            closing * ((1 + (ratio == 4)) * ratio * 2 * layout.HEAD_DIM * 4
                       + layout.BYTES_PER_TOKEN),
        )
        del state
    return results


PREFILL_SHAPES = (  # (query tokens, heads, list width): C4A's 512 + window, top-k 2048 + window
    (4096, 16, 640), (4096, 64, 640), (4096, 16, 2176), (4096, 64, 2176))
PREFILL_KV_ROWS = 32768  # a chunk's gathered rows (bf16, 32 MiB)


def prefill_cases(quick: bool, cuda_arch: str | None) -> list[dict[str, object]]:
    """The sparse prefill on a chunk's gathered rows, Triton's and the CUDA build
    (`cuda_arch`'s; None: the card's), beside a dense bf16 matmul of the same flops by
    cuBLAS in the same run (Hopper's wgmma on the H200: a ceiling that sm80 code, limited
    to mma.sync, cannot reach; an A100's bf16 peak is 312 TFLOP/s)."""
    from services.engine.backport.kernels import ds_mla_cache as layout
    from services.engine.backport.kernels.sparse_mla_prefill import sparse_mla_prefill
    from services.engine.backport.kernels.sparse_mla_prefill_cuda import (
        sparse_mla_prefill_cuda,
    )

    kv = torch.randn(PREFILL_KV_ROWS, 1, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    rows = []
    cuda = functools.partial(sparse_mla_prefill_cuda, arch=cuda_arch)
    # (label, function, its tiling arguments)
    configs: list[tuple[str, Callable[..., object], dict[str, int]]] = [
        ("triton", sparse_mla_prefill, {}), ("cuda", cuda, {})]
    if not quick:
        configs += [("triton", sparse_mla_prefill, config) for config in (
            {"num_stages": 1}, {"num_stages": 3}, {"block_n": 64},
            {"heads_per_program": 32, "num_warps": 8},
            {"heads_per_program": 64, "num_warps": 8})]
        configs += [("cuda", cuda, config) for config in (
            {"stages": 3}, {"stages": 4}, {"min_blocks": 3})]
    for tokens, heads, width in PREFILL_SHAPES[:2] if quick else PREFILL_SHAPES:
        q = torch.randn(tokens, heads, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        picks = torch.stack([torch.randperm(PREFILL_KV_ROWS, device="cuda")[:width]
                             for _ in range(tokens)])
        indices = picks.to(torch.int32).unsqueeze(1)
        sink = torch.randn(heads, device="cuda")
        out = torch.empty_like(q)
        flops = 4 * tokens * heads * width * layout.HEAD_DIM
        scores = torch.randn(tokens * heads, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(layout.HEAD_DIM, width, device="cuda", dtype=torch.bfloat16)
        dense_ms = bench_graph_ms(lambda: torch.matmul(scores, keys))
        dense_rate = 2 * tokens * heads * width * layout.HEAD_DIM / dense_ms * 1e-9
        for label, prefill, config in configs:
            def run(prefill: Callable[..., object] = prefill,
                    config: dict[str, int] = config) -> object:
                return prefill(q, kv, indices, layout.HEAD_DIM**-0.5, attn_sink=sink, out=out,
                               **config)
            try:
                graph_ms = bench_graph_ms(run)
            except Exception as error:  # noqa: BLE001 - a config over the limits is a result
                print(f"prefill {label} {config} failed: {type(error).__name__}: {error}",
                      flush=True)
                continue
            rows.append({
                "shape": f"S_q={tokens} H={heads} K={width}",
                "config": label + "".join(f",{k}={v}" for k, v in config.items()),
                "graph ms": graph_ms,
                "TFLOP/s": flops / graph_ms * 1e-9,
                "dense bf16 TFLOP/s": dense_rate,
            })
            print(prefill_markdown(rows[-1:]).splitlines()[-1], flush=True)
    return rows


INDEXER_HEADS, INDEXER_DIM = 64, 128  # DeepSeek-V4's indexer: 64 heads of 128 dims
# The decode logits' width vLLM asks for when the model is served with a 1M-token
# max_model_len: max_model_len over the indexer's compress ratio of 4.
SERVED_LOGITS_WIDTH = (1 << 20) // 4


# Decode steps of the indexer logits: rows (requests of one token) x keys a row.
INDEXER_DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
INDEXER_DECODE_KEYS = (4096, 32768)
# Uneven decode steps: one long row among short ones, and its keys spread evenly.
INDEXER_UNEVEN_ROWS = ((131072,) + (4096,) * 63, (6080,) * 64,
                       (131072,) + (4096,) * 7, (19968,) * 8)


def indexer_cases(bandwidth: float, cuda_arch: str | None) -> list[dict[str, object]]:
    """The indexer's logits: a 4k-token prefill chunk at the end of a 128k-token context
    (32k compressed keys), beside a dense bf16 matmul of the same flops by cuBLAS; decode
    steps of 1 to 64 rows of 4k and 32k keys, logits as wide as vLLM asks for a 1M-token
    model, as bytes against the copy bandwidth, by the Triton kernel and by the CUDA one
    (the arch's build, as `op_adapters.fp8_fp4_paged_mqa_logits` runs it) with its row
    grid, whose ratio is its speedup over the Triton kernel, and with its balanced grid,
    whose ratio is its speedup over the row grid, all in the same run, the route's grid
    marked; then uneven steps (one long row among short ones) beside the same keys spread
    evenly."""
    from services.engine.backport.kernels.cuda_module import device_arch
    from services.engine.backport.kernels.mqa_logits import mqa_logits
    from services.engine.backport.kernels.paged_mqa_logits import SCALE_BYTES, paged_mqa_logits
    from services.engine.backport.kernels.paged_mqa_logits_cuda import (
        balanced_for_rows,
        default_min_blocks,
        paged_mqa_logits_cuda,
    )

    def fp8(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device="cuda").to(torch.float8_e4m3fn)

    rows = []
    tokens, keys = 4096, 32768
    q, k = fp8(tokens, INDEXER_HEADS, INDEXER_DIM), fp8(keys, INDEXER_DIM)
    k_scale = torch.rand(keys, device="cuda")
    weights = torch.randn(tokens, INDEXER_HEADS, device="cuda")
    ks = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    ke = (keys - (tokens - 1 - torch.arange(tokens, device="cuda")) // 4).to(torch.int32)
    flops = 2 * INDEXER_HEADS * INDEXER_DIM * int((ke - ks).sum())
    graph_ms = bench_graph_ms(lambda: mqa_logits(q, k, k_scale, weights, ks, ke))
    a = torch.randn(tokens * INDEXER_HEADS // 4, INDEXER_DIM, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(INDEXER_DIM, keys, device="cuda", dtype=torch.bfloat16)
    dense_ms = bench_graph_ms(lambda: torch.matmul(a, b))
    dense_rate = 2 * a.shape[0] * INDEXER_DIM * keys / dense_ms * 1e-9
    rows.append({"shape": f"prefill M={tokens} N={keys} H={INDEXER_HEADS}",
                 "graph ms": graph_ms, "TFLOP/s": flops / graph_ms * 1e-9,
                 "baseline": f"cuBLAS bf16 {dense_rate:.0f} TFLOP/s",
                 "ratio": flops / graph_ms * 1e-9 / dense_rate})
    block_size, width = 64, SERVED_LOGITS_WIDTH
    arch = cuda_arch or device_arch(torch.device("cuda"))
    steps = [(f"B={batch} keys={context}", (context,) * batch)
             for context in INDEXER_DECODE_KEYS for batch in INDEXER_DECODE_ROWS]
    steps += [(f"B={len(lengths)} keys={lengths[0]}" if len(set(lengths)) == 1 else
               f"B={len(lengths)} keys={lengths[0]} + {len(lengths) - 1}x{lengths[1]}", lengths)
              for lengths in INDEXER_UNEVEN_ROWS]
    for label, lengths in steps:
        batch, pages = len(lengths), [-(-length // block_size) for length in lengths]
        blocks = sum(pages)
        cache = torch.randint(0, 255, (blocks, block_size * (INDEXER_DIM + SCALE_BYTES)),
                              dtype=torch.uint8, device="cuda")
        view = cache.view(blocks, block_size, 1, INDEXER_DIM + SCALE_BYTES)
        cache[:, block_size * INDEXER_DIM:].view(torch.float32).copy_(
            torch.rand(blocks, block_size, device="cuda"))
        order = torch.randperm(blocks, device="cuda").to(torch.int32)
        tables = torch.zeros(batch, max(pages), dtype=torch.int32, device="cuda")
        for row, (first, count) in enumerate(zip(itertools.accumulate([0] + pages), pages)):
            tables[row, :count] = order[first:first + count]
        qd = fp8(batch, 1, INDEXER_HEADS, INDEXER_DIM)
        wd = torch.randn(batch, INDEXER_HEADS, device="cuda")
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        moved = sum(lengths) * (INDEXER_DIM + SCALE_BYTES + 4)
        flops = 2 * sum(lengths) * INDEXER_HEADS * INDEXER_DIM
        shape = f"decode {label} of {width} columns H={INDEXER_HEADS}"
        triton_ms = bench_graph_ms(lambda: paged_mqa_logits(qd, view, wd, lens, tables, width))
        rate = moved / (triton_ms * 1e-3)
        rows.append({"shape": shape, "graph ms": triton_ms, "TFLOP/s": flops / triton_ms * 1e-9,
                     "baseline": f"{rate / 1e9:.0f} GB/s of {bandwidth / 1e9:.0f} GB/s copy",
                     "ratio": rate / bandwidth})
        grid_ms = {}
        for balanced in (False, True):
            grid_ms[balanced] = bench_graph_ms(lambda: paged_mqa_logits_cuda(
                qd, view, wd, lens, tables, width, arch=arch,
                min_blocks=default_min_blocks(arch), balanced=balanced))
        route = {balanced: " (route)" if balanced == balanced_for_rows(batch) else ""
                 for balanced in (False, True)}
        rows.append({"shape": f"{shape} CUDA row grid{route[False]}",
                     "graph ms": grid_ms[False], "TFLOP/s": flops / grid_ms[False] * 1e-9,
                     "baseline": f"Triton {triton_ms:.4f} ms",
                     "ratio": triton_ms / grid_ms[False]})
        rows.append({"shape": f"{shape} CUDA balanced{route[True]}", "graph ms": grid_ms[True],
                     "TFLOP/s": flops / grid_ms[True] * 1e-9,
                     "baseline": f"row grid {grid_ms[False]:.4f} ms",
                     "ratio": grid_ms[False] / grid_ms[True]})
        print(indexer_markdown(rows[-3:]).split("\n", 2)[2], flush=True)
        del cache
    return rows


# DeepSeek-V4-Flash's output projection: wo_a maps each group of 8 heads (8 x 512 dims) to
# a 1024-wide slice; 8 groups at TP1, 2 at TP4 (the Ampere deployment).
EINSUM_OUT_DIM, EINSUM_REDUCE_DIM = 1024, 4096
# (block_t, block_d, warps, stages, splits): splits 0 is the launcher's pick, 1 none. The
# prefill's second is its tiling before the twentieth session.
EINSUM_DECODE_TILINGS = ((16, 32, 4, 3, 0), (16, 128, 8, 3, 0), (16, 64, 4, 3, 1),
                         (16, 64, 4, 4, 0), (32, 32, 4, 3, 0), (32, 64, 4, 3, 0),
                         (64, 32, 4, 3, 0), (64, 64, 4, 3, 0), (64, 128, 8, 3, 0))
EINSUM_PREFILL_TILINGS = ((128, 128, 8, 3, 0), (128, 128, 8, 2, 0), (128, 128, 8, 2, 1),
                          (64, 64, 4, 3, 0), (64, 128, 4, 3, 0))


def einsum_cases(bandwidth: float, quick: bool) -> list[dict[str, object]]:
    """The output projection's fp8 einsum: decode steps as bytes against the copy bandwidth
    (each call on another copy of the weight, so it comes from memory), a 4k-token prefill
    chunk in TFLOP/s beside cuBLAS's bf16 bmm of the same shape in the same run."""
    from services.engine.backport.kernels.fp8_e4m3 import hardware_fp8_encode
    from services.engine.backport.kernels.fp8_einsum import (
        SCALE_BLOCK,
        EinsumTiling,
        default_tiling,
        fp8_einsum,
    )

    rows = []
    blocks = EINSUM_REDUCE_DIM // SCALE_BLOCK
    for groups in (2, 8):
        w = torch.randn(groups, EINSUM_OUT_DIM, EINSUM_REDUCE_DIM, device="cuda").to(
            torch.float8_e4m3fn)
        w_scale = torch.rand(groups, EINSUM_OUT_DIM // SCALE_BLOCK, blocks, device="cuda")
        weights = [w] + [w.clone() for _ in range(COLD_BYTES // w.numel() - 1)]
        for tokens in (1, 8, 32, 64, 256, 4096):
            x = torch.randn(groups, tokens, EINSUM_REDUCE_DIM, device="cuda").to(
                torch.float8_e4m3fn).transpose(0, 1)
            x_scale = torch.rand(groups, blocks, tokens, device="cuda").permute(2, 0, 1)
            out = torch.empty(tokens, groups, EINSUM_OUT_DIM, device="cuda", dtype=torch.bfloat16)
            moved = w.numel() + w_scale.numel() * 4 + x.numel() * 5 // 4 + out.numel() * 2
            flops = 2 * tokens * groups * EINSUM_OUT_DIM * EINSUM_REDUCE_DIM
            prefill = tokens > 64
            calls = [w] if prefill else weights
            if prefill:
                a = torch.randn(groups, tokens, EINSUM_REDUCE_DIM, device="cuda",
                                dtype=torch.bfloat16)
                b = torch.randn(groups, EINSUM_REDUCE_DIM, EINSUM_OUT_DIM, device="cuda",
                                dtype=torch.bfloat16)
                dense_ms = bench_graph_ms(lambda: torch.bmm(a, b))
                baseline = f"cuBLAS bf16 bmm {flops / dense_ms * 1e-9:.0f} TFLOP/s"
            else:
                baseline = (f"{bandwidth / 1e9:.0f} GB/s copy; a cold copy of its bytes "
                            f"{copy_share(moved, bandwidth, cold=True):.0%}")
            tilings = [default_tiling(tokens, hardware_fp8_encode(x.device))]
            if not quick:
                tilings += [EinsumTiling(*t) for t in
                            (EINSUM_PREFILL_TILINGS if prefill else EINSUM_DECODE_TILINGS)]
            for tiling in tilings:
                def run(tiling: EinsumTiling = tiling) -> None:
                    for weight in calls:
                        fp8_einsum(x, x_scale, weight, w_scale, out, tiling)
                try:
                    graph_ms = bench_graph_ms(run) / len(calls)
                except Exception as error:  # noqa: BLE001 - a tiling over the limits is a result
                    print(f"einsum {tiling} failed: {type(error).__name__}: {error}", flush=True)
                    continue
                rows.append({
                    "shape": f"T={tokens} G={groups}",
                    "config": "default" if tiling is tilings[0] else
                    f"{tiling.block_t}x{tiling.block_d} w{tiling.num_warps} s{tiling.num_stages}"
                    f" split {tiling.splits or 'picked'}",
                    "graph ms": graph_ms,
                    "TFLOP/s": flops / graph_ms * 1e-9,
                    "of copy": moved / (graph_ms * 1e-3) / bandwidth,
                    "baseline": baseline,
                    "ratio": dense_ms / graph_ms if prefill else moved / (graph_ms * 1e-3)
                    / bandwidth,
                })
                print(einsum_markdown(rows[-1:]).splitlines()[-1], flush=True)
        del weights
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def einsum_markdown(rows: list[dict[str, object]]) -> str:
    return table(
        ["fp8 einsum", "config", "graph ms", "TFLOP/s", "of copy", "baseline (same run)",
         "ratio"],
        [[str(row["shape"]), str(row["config"]), f"{row['graph ms']:.4g}",
          f"{row['TFLOP/s']:.4g}", f"{row['of copy']:.0%}", str(row["baseline"]),
          f"{row['ratio']:.0%}"] for row in rows])


def indexer_markdown(rows: list[dict[str, object]]) -> str:
    return table(
        ["indexer logits", "graph ms", "TFLOP/s", "baseline (same run)", "ratio"],
        [[str(row["shape"]), f"{row['graph ms']:.4g}", f"{row['TFLOP/s']:.4g}",
          str(row["baseline"]), f"{row['ratio']:.0%}"] for row in rows])


def prefill_markdown(rows: list[dict[str, object]]) -> str:
    return table(
        ["shape", "config", "graph ms", "TFLOP/s", "cuBLAS dense bf16 TFLOP/s", "ratio"],
        [[str(row["shape"]), str(row["config"]), f"{row['graph ms']:.4g}",
          f"{row['TFLOP/s']:.4g}", f"{row['dense bf16 TFLOP/s']:.4g}",
          f"{row['TFLOP/s'] / row['dense bf16 TFLOP/s']:.0%}"] for row in rows])


def markdown(rows: list[dict[str, object]]) -> str:
    header = [
        "kernel",
        "shape",
        "config",
        "ms",
        "graph ms",
        "GB/s",
        "of copy",
        "TFLOP/s",
        "new variants",
    ]

    def cell(key: str, value: object) -> str:
        if key == "of copy":
            return f"{value:.0%}"
        if isinstance(value, float):
            return f"{value:.4g}"
        return "-" if value is None else str(value)

    return table(header, [[cell(key, row.get(key)) for key in header] for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu-arch", choices=["sm80", "sm86", "sm89", "native"], default="sm80")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer shapes; the quantizers' smaller inputs fit in the L2, so their rates flatter",
    )
    parser.add_argument(
        "--profile-decode",
        type=int,
        nargs="?",
        const=16,
        metavar="HEADS",
        help="only launch the B=64 top-k 2048 decode with HEADS heads (16) a few times (for ncu)",
    )
    parser.add_argument(
        "--compare-decode",
        action="store_true",
        help="only time the Triton and the CUDA decode side by side (graph replay)",
    )
    parser.add_argument(
        "--decode-backend",
        choices=["triton", "cuda"],
        default="triton",
        help="the decode --profile-decode, --sweep-decode and --sweep-splits run "
        "(cuda: sparse_mla_sm80.cu)",
    )
    parser.add_argument(
        "--quantizers", action="store_true", help="only time the quantizers and gathers"
    )
    parser.add_argument(
        "--indexer", action="store_true", help="only time the indexer's logits",
    )
    parser.add_argument(
        "--einsum", action="store_true",
        help="only time the output projection's fp8 einsum (tiling choices too unless --quick)",
    )
    parser.add_argument(
        "--prefill", action="store_true",
        help="only time the sparse prefill (tiling choices too unless --quick)",
    )
    parser.add_argument(
        "--sweep-splits",
        action="store_true",
        help="only time the decode (--decode-backend) at every split count beside its rule's "
        "pick (--out writes the rows)",
    )
    parser.add_argument(
        "--sms",
        type=int,
        default=None,
        help="run on a green context of this many SMs (A100 108, A6000 84; the driver rounds "
        "up to its partition size, 8 on the H200); the decodes' split rules see them",
    )
    parser.add_argument(
        "--sweep-decode",
        action="store_true",
        help="only time the decode's tiling choices (--decode-backend picks which decode)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA card")
    if args.gpu_arch != "native":
        from services.engine.backport.kernels.arch_fidelity import enable_arch_emulation

        cache_dir = tempfile.mkdtemp(prefix="triton-bench-")
        # A fresh cache per run, so that no kernel built for another arch is reused; its
        # builds are hundreds of MB left in /tmp otherwise.
        atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
        enable_arch_emulation(args.gpu_arch, cache_dir)

    cuda_arch = args.gpu_arch if args.gpu_arch != "native" else None
    green = use_sms(args.sms) if args.sms else None  # referenced until main returns
    if args.sweep_splits:
        sweep_splits(args.decode_backend, cuda_arch, args.out)
        return
    if args.profile_decode:
        profile_decode(args.profile_decode, args.decode_backend, cuda_arch)
        return
    if args.sweep_decode:
        sweep_decode(copy_bandwidth(), args.decode_backend, cuda_arch)
        return
    if args.compare_decode:
        compare_decode(copy_bandwidth(), cuda_arch)
        return
    bandwidth = copy_bandwidth()
    print(
        f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s"
        f" on {torch.cuda.get_device_name()}, "
        f"kernels compiled for {args.gpu_arch}",
        flush=True,
    )
    if args.quantizers:
        print(markdown(quantizer_cases(bandwidth, args.quick)))
        return
    if args.prefill:
        print(prefill_markdown(prefill_cases(args.quick, cuda_arch)))
        return
    if args.indexer:
        print(indexer_markdown(indexer_cases(bandwidth, cuda_arch)))
        return
    if args.einsum:
        print(einsum_markdown(einsum_cases(bandwidth, args.quick)))
        return
    rows: list[dict[str, object]] = []
    contexts = [8192, 131072] if args.quick else [8192, 32768, 131072]
    max_batch = 64
    cache = filled_cache(max_batch * max(contexts) // COMPRESS_RATIO)
    swa_cache = filled_cache(max_batch * SWA_WINDOW)
    for heads in (16, 64):
        for batch in (1, 8, 64):
            for topk in (512, 2048):
                for context in contexts:
                    for backend, config in (("triton", {}), ("cuda", {"cuda_arch": cuda_arch})):
                        rows.append(decode_case(batch, topk, context, heads, cache, swa_cache,
                                                bandwidth, backend, **config))
                        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    for config in (
        {"heads_per_program": 16, "block_n": 16, "num_warps": 4},
        {"heads_per_program": 16, "block_n": 32, "num_warps": 8},
        {"heads_per_program": 16, "block_n": 64, "num_warps": 8},
    ):
        try:
            rows.append(decode_case(64, 2048, 32768, 64, cache, swa_cache, bandwidth, **config))
        except Exception as error:  # noqa: BLE001 - a config over the card's limits is a result too
            print(f"config {config} failed: {type(error).__name__}: {error}", flush=True)
    rows.extend(quantizer_cases(bandwidth, args.quick))
    prefill_rows = prefill_cases(True, cuda_arch)
    indexer_rows = indexer_cases(bandwidth, cuda_arch)
    einsum_rows = einsum_cases(bandwidth, quick=True)

    from services.engine.backport.kernels import (
        fp8_einsum,
        indexer_k_compress,
        indexer_q_quant,
        inv_rope_fp8_quant,
        k_cache_gather,
        k_cache_insert,
        mqa_logits,
        paged_mqa_logits,
        sparse_mla_combine,
        sparse_mla_decode,
        sparse_mla_prefill,
    )
    from services.engine.backport.kernels.arch_fidelity import compiled_kernel_reports

    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; kernels compiled for {args.gpu_arch}\n")
    print(markdown(rows))
    print("\nsparse MLA prefill (graph replay):\n" + prefill_markdown(prefill_rows))
    print("\n" + indexer_markdown(indexer_rows))
    print("\n" + einsum_markdown(einsum_rows))
    modules = [
        sparse_mla_decode,
        sparse_mla_combine,
        k_cache_insert,
        k_cache_gather,
        indexer_q_quant,
        inv_rope_fp8_quant,
        indexer_k_compress,
        sparse_mla_prefill,
        mqa_logits,
        paged_mqa_logits,
        fp8_einsum,
    ]
    print("\ncompiled variants (shared B, registers, spills):")
    for report in compiled_kernel_reports(modules):
        print(
            f"  {report.name}: {report.shared_bytes} B, {report.registers} regs,"
            f" {report.spills} spills ({report.card_spills} in the timed build)"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"copy_bytes_per_s": bandwidth, "arch": args.gpu_arch, "rows": rows,
                 "prefill_rows": prefill_rows, "indexer_rows": indexer_rows}, indent=1
            )
        )


if __name__ == "__main__":
    main()
