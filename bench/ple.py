"""PLE offload benchmark: gather throughput from shared memory against memcpy bandwidth
(same run), and gRPC / shared-memory latency of one decode step's lookup.

    python bench/ple.py [--table-gib 2] [--row-bytes 160] [--decode-tokens 64]

Starts a PLE service on a synthetic table (a sparse file: no disk, but every row is written
into shared memory), measures, stops the service and removes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "protos")]

from services.mesh.channels import wait_until_serving  # noqa: E402
from services.ple_offload.client import PleTableClient  # noqa: E402
from services.ple_offload.table_reader import SharedTableReader  # noqa: E402

HEADS = 16


def write_table(path: Path, num_rows: int, row_bytes: int) -> None:
    header = {"ple.ngram_embedding.weight": {"dtype": "F8_E4M3", "shape": [num_rows, row_bytes],
                                             "data_offsets": [0, num_rows * row_bytes]},
              "ple.ngram_embedding.weight_scale": {"dtype": "F32", "shape": [],
                                                   "data_offsets": [num_rows * row_bytes,
                                                                    num_rows * row_bytes + 4]}}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.seek(num_rows * row_bytes, os.SEEK_CUR)
        f.write(struct.pack("<f", 1.0))


def start_service(table: Path, shm_name: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*sys.path[:2], os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "services.ple_offload", "--table-path", str(table), "--address",
         address, "--shm-name", shm_name, "--no-show-progress"], cwd=REPO_ROOT, env=env)
    while not wait_until_serving(address, 5):
        if process.poll() is not None:
            raise SystemExit(f"PLE service exited with {process.returncode}")
    return process, address


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def percentiles_ms(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    for _ in range(max(50, calls // 10)):
        fn()
    samples = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter()
        fn()
        samples[i] = time.perf_counter() - start
    return float(np.percentile(samples, 50) * 1e3), float(np.percentile(samples, 99) * 1e3)


def memcpy_gb_s(rows: np.ndarray, pool: ThreadPoolExecutor | None, threads: int) -> float:
    """One large contiguous copy out of the shared table, split over `threads`."""
    src = rows[:min(rows.shape[0], (1 << 30) // rows.shape[1])]
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.shape[0], threads + 1, dtype=np.int64)
    parts = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def copy() -> None:
        if pool is None:
            np.copyto(dst, src)
        else:
            for done in [pool.submit(np.copyto, dst[p], src[p]) for p in parts]:
                done.result()

    copy()
    return src.nbytes / best_seconds(copy, 5) / 1e9


def gather_gb_s(reader: SharedTableReader, num_rows: int, tokens: int) -> float:
    """Random rows, a fresh batch per call, so repeated ids never come from cache."""
    rng = np.random.default_rng(tokens)
    num_batches = max(4, (64 << 20) // (tokens * HEADS * 160))
    batches = [rng.integers(0, num_rows, (tokens, HEADS)) for _ in range(num_batches)]
    out = np.empty((tokens, HEADS, reader.header.row_bytes), np.uint8)

    def run() -> None:
        for batch in batches:
            reader.gather(batch, out=out)

    run()
    return num_batches * out.nbytes / best_seconds(run, 3) / 1e9


def measure(address: str, shm_name: str, args: argparse.Namespace) -> dict[str, float]:
    threads = args.threads
    results: dict[str, float] = {"threads": threads}
    for count in (1, threads):
        reader = SharedTableReader(shm_name, gather_threads=count)
        rows = reader.table_rows()
        num_rows = rows.shape[0]
        with ThreadPoolExecutor(count) as pool:
            memcpy = memcpy_gb_s(rows, pool if count > 1 else None, count)
        results[f"memcpy_{count}t_gb_s"] = memcpy
        for label, tokens in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
            gbs = gather_gb_s(reader, num_rows, tokens)
            results[f"gather_{label}_{count}t_gb_s"] = gbs
            results[f"gather_{label}_{count}t_vs_memcpy_{count}t"] = gbs / memcpy
            results[f"gather_{label}_{count}t_vs_memcpy_1t"] = gbs / results["memcpy_1t_gb_s"]
        del rows
        reader.close()

    decode_ids = np.random.default_rng(1).integers(0, num_rows, (args.decode_tokens, HEADS))
    reader = SharedTableReader(shm_name)
    results["shm_step_p50_ms"], results["shm_step_p99_ms"] = percentiles_ms(
        lambda: reader.gather(decode_ids), args.calls)
    reader.close()
    client = PleTableClient(address, allow_shared_memory=False)
    results["grpc_step_p50_ms"], results["grpc_step_p99_ms"] = percentiles_ms(
        lambda: client.gather(decode_ids), args.calls)
    results["grpc_describe_p50_ms"], results["grpc_describe_p99_ms"] = percentiles_ms(
        client.describe, args.calls)
    client.close()
    return results


def report(results: dict[str, float], args: argparse.Namespace, table_gib: float) -> None:
    threads = args.threads
    print(f"table {table_gib:.2f} GiB of {args.row_bytes} B rows, {HEADS} rows per token")
    for count in sorted({1, threads}):
        print(f"{count} thread(s): memcpy {results[f'memcpy_{count}t_gb_s']:.2f} GB/s")
        for label, tokens in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
            print(f"  shm gather {label:7s} {tokens:5d}x{HEADS}: "
                  f"{results[f'gather_{label}_{count}t_gb_s']:.2f} GB/s = "
                  f"{results[f'gather_{label}_{count}t_vs_memcpy_{count}t']:.2f} x memcpy "
                  f"({count} t), {results[f'gather_{label}_{count}t_vs_memcpy_1t']:.2f} x memcpy (1 t)")
    step = f"{args.decode_tokens}x{HEADS}"
    print(f"shm  lookup {step}: p50 {results['shm_step_p50_ms']:.3f} ms, "
          f"p99 {results['shm_step_p99_ms']:.3f} ms")
    print(f"gRPC lookup {step}: p50 {results['grpc_step_p50_ms']:.3f} ms, "
          f"p99 {results['grpc_step_p99_ms']:.3f} ms (loopback, {args.calls} calls; empty "
          f"Describe RPC: p50 {results['grpc_describe_p50_ms']:.3f} ms, "
          f"p99 {results['grpc_describe_p99_ms']:.3f} ms)")
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-gib", type=float, default=2.0)
    parser.add_argument("--row-bytes", type=int, default=160)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1),
                        help="threads for the parallel gather and memcpy")
    args = parser.parse_args()
    num_rows = int(args.table_gib * 2**30) // args.row_bytes
    shm_name = f"backport-ple-bench-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "table.safetensors"
        write_table(table, num_rows, args.row_bytes)
        process, address = start_service(table, shm_name)
        try:
            report(measure(address, shm_name, args), args, num_rows * args.row_bytes / 2**30)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


if __name__ == "__main__":
    main()
