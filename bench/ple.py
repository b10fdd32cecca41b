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


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def percentiles_ms(fn, calls: int) -> tuple[float, float]:
    for _ in range(max(50, calls // 10)):
        fn()
    samples = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter()
        fn()
        samples[i] = time.perf_counter() - start
    return float(np.percentile(samples, 50) * 1e3), float(np.percentile(samples, 99) * 1e3)


def measure(address: str, shm_name: str, args: argparse.Namespace) -> None:
    reader = SharedTableReader(shm_name)
    rows = reader.table_rows()
    num_rows, row_bytes = rows.shape
    rng = np.random.default_rng(0)

    # memcpy: one large contiguous copy out of the same shared table.
    copy_rows = min(num_rows, (512 * 2**20) // row_bytes)
    src = rows[:copy_rows]
    dst = np.empty_like(src)
    np.copyto(dst, src)
    memcpy_gbs = src.nbytes / best_seconds(lambda: np.copyto(dst, src), 5) / 1e9

    results = {"table_gib": num_rows * row_bytes / 2**30, "row_bytes": row_bytes,
               "memcpy_gb_s": memcpy_gbs}
    for label, tokens in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
        batches = [rng.integers(0, num_rows, (tokens, HEADS)) for _ in range(16)]
        out = np.empty((tokens, HEADS, row_bytes), np.uint8)
        batch_iter = iter(range(10**9))

        def gather() -> None:
            reader.gather(batches[next(batch_iter) % len(batches)], out=out)

        seconds = best_seconds(lambda: [gather() for _ in range(16)], 5) / 16
        gbs = out.nbytes / seconds / 1e9
        results[f"shm_gather_{label}_gb_s"] = gbs
        results[f"shm_gather_{label}_vs_memcpy"] = gbs / memcpy_gbs
    decode_ids = rng.integers(0, num_rows, (args.decode_tokens, HEADS))
    out = np.empty((args.decode_tokens, HEADS, row_bytes), np.uint8)
    p50, p99 = percentiles_ms(lambda: reader.gather(decode_ids, out=out), args.calls)
    results |= {"shm_decode_step_p50_ms": p50, "shm_decode_step_p99_ms": p99}
    client = PleTableClient(address, allow_shared_memory=False)
    p50, p99 = percentiles_ms(lambda: client.gather(decode_ids), args.calls)
    results |= {"grpc_decode_step_p50_ms": p50, "grpc_decode_step_p99_ms": p99}
    client.close()
    del rows, src
    reader.close()

    print(f"table {results['table_gib']:.2f} GiB, {row_bytes} B rows, {HEADS} rows/token")
    print(f"memcpy bandwidth (same table, 512 MiB copy): {memcpy_gbs:.2f} GB/s")
    for label, tokens in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
        print(f"shm gather, {label} {tokens}x{HEADS} random rows: "
              f"{results[f'shm_gather_{label}_gb_s']:.2f} GB/s = "
              f"{results[f'shm_gather_{label}_vs_memcpy']:.2f} x memcpy")
    print(f"shm  lookup {args.decode_tokens}x{HEADS}: p50 {results['shm_decode_step_p50_ms']:.3f} ms, "
          f"p99 {results['shm_decode_step_p99_ms']:.3f} ms")
    print(f"gRPC lookup {args.decode_tokens}x{HEADS}: p50 {results['grpc_decode_step_p50_ms']:.3f} ms, "
          f"p99 {results['grpc_decode_step_p99_ms']:.3f} ms (loopback, {args.calls} calls)")
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-gib", type=float, default=2.0)
    parser.add_argument("--row-bytes", type=int, default=160)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    num_rows = int(args.table_gib * 2**30) // args.row_bytes
    shm_name = f"backport-ple-bench-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "table.safetensors"
        write_table(table, num_rows, args.row_bytes)
        process, address = start_service(table, shm_name)
        try:
            measure(address, shm_name, args)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


if __name__ == "__main__":
    main()
