"""PLE offload benchmark: gather throughput from shared memory against memcpy bandwidth
and against the rate one core reads random cache lines (same run), and the latency of one
decode step's lookup: shared memory, gRPC LookupStream and unary Lookup, beside the same
bytes over a bare grpcio stream, an empty gRPC call and a bare loopback TCP round trip.

    python bench/ple.py [--table-gib 2] [--threads 8] [--rounds 5] [--shm-dir /dev/shm]
    python bench/ple.py --service-cpus 2 --client-cpus 3   # each side on its own core
    python bench/ple.py --gpu [--table-gib 8]

--gpu measures the GPU path instead: the table registered with CUDA in place, rows
gathered by torch.index_select on the GPU over PCIe, against the pinned-host -> device
copy bandwidth of the same run, and one decode step's latency (GPU gather, and for
comparison the host gather + copy it replaces).

Starts a PLE service on a synthetic table (a sparse file: no disk, but every row is written
into shared memory), measures, stops the service and removes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
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
from statistics import median
from typing import Any

import grpc
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "protos")]

from backport.v1 import ple_pb2  # noqa: E402

from services.mesh.channels import GRPC_OPTIONS, wait_until_serving  # noqa: E402
from services.ple_offload.client import PleTableClient  # noqa: E402
from services.mesh.grpc_io import GRPC_EXPERIMENTS_ENV, POLLING_THREAD_IO  # noqa: E402
from services.ple_offload.table_reader import SharedTableReader  # noqa: E402

HEADS = 16
MEMCPY_BYTES = 1 << 30
LINE_BYTES = 64


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


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*sys.path[:2], os.environ.get("PYTHONPATH", "")]))


def cpu_set(text: str) -> set[int]:
    """CPUs written as taskset does: "2", "2-3", "0,4-5"."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pinned(child: subprocess.Popen[bytes], cpus: set[int]) -> subprocess.Popen[bytes]:
    """`child` moved to `cpus`, with every thread it starts later. Popen returns once the
    child has exec'd, tens of ms before the interpreter could start a thread. (A preexec_fn
    would fork this process with grpc's threads running, which grpc logs as an error.)"""
    os.sched_setaffinity(child.pid, cpus)
    return child


def start_service(table: Path, shm_name: str, shm_dir: Path,
                  cpus: set[int]) -> tuple[subprocess.Popen[bytes], str]:
    address = _free_address()
    cpu_flags = [arg for cpu in sorted(cpus) for arg in ("--cpus", str(cpu))]
    process = subprocess.Popen(
        [sys.executable, "-m", "services.ple_offload", "--table-path", str(table), "--address",
         address, "--shm-name", shm_name, "--shm-dir", str(shm_dir), "--no-show-progress",
         *cpu_flags], cwd=REPO_ROOT, env=_child_env())
    try:
        while not wait_until_serving(address, 5):
            if process.poll() is not None:
                raise SystemExit(f"PLE service exited with {process.returncode}")
    except BaseException:  # stopped while the service starts: stop it too
        process.terminate()
        process.wait(60)
        raise
    return process, address


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def percentiles_ms(fn: Callable[[int], object], calls: int) -> tuple[float, float]:
    """p50 and p99 of `calls` calls, after a warm-up; `fn` gets the call's index."""
    for i in range(max(50, calls // 10)):
        fn(i)
    samples = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        samples[i] = time.perf_counter() - start
    return float(np.percentile(samples, 50) * 1e3), float(np.percentile(samples, 99) * 1e3)


class MemcpyBaseline:
    """The machine's memcpy bandwidth: one contiguous copy of MEMCPY_BYTES (or the whole
    table, if smaller) out of the shared table into a private, already faulted-in buffer,
    split over `threads`, best of 5. Reading the same pages the gathers read keeps the
    comparison about access pattern alone."""

    def __init__(self, rows: np.ndarray, threads: int) -> None:
        self.src = rows[:min(rows.shape[0], MEMCPY_BYTES // rows.shape[1])]
        self.dst = np.empty_like(self.src)
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None
        bounds = np.linspace(0, self.src.shape[0], threads + 1, dtype=np.int64)
        self.parts = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        self.copy()

    def copy(self) -> None:
        if self.pool is None:
            np.copyto(self.dst, self.src)
        else:
            for done in [self.pool.submit(np.copyto, self.dst[p], self.src[p]) for p in self.parts]:
                done.result()

    def gb_s(self) -> float:
        return self.src.nbytes / best_seconds(self.copy, 5) / 1e9

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        del self.src


class GatherLoad:
    """Random ids, a fresh batch per call (so no row comes from cache), gathered into a
    preallocated buffer the way an engine step does."""

    def __init__(self, reader: SharedTableReader, tokens: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        num_rows = reader.header.num_rows
        num_batches = max(4, (64 << 20) // (tokens * HEADS * reader.header.row_bytes))
        self.reader = reader
        self.batches = [rng.integers(0, num_rows, (tokens, HEADS)) for _ in range(num_batches)]
        self.out = np.empty((tokens, HEADS, reader.header.row_bytes), np.uint8)
        self.run()

    def run(self) -> None:
        for batch in self.batches:
            self.reader.gather(batch, out=self.out)

    def gb_s(self) -> float:
        return len(self.batches) * self.out.nbytes / best_seconds(self.run, 3) / 1e9


class RandomLineReads:
    """One byte from each of a batch of random 64-byte lines of the table a call, fresh
    lines each call as `GatherLoad` draws rows: how fast one core brings in lines that
    miss the caches. No gather of random rows can beat one such read a row; a 160-byte
    row spans three lines, which the core's prefetch of a line's neighbour may fetch in
    fewer reads."""

    def __init__(self, rows: np.ndarray, reads_a_call: int, seed: int) -> None:
        self.table = rows.reshape(-1)
        rng = np.random.default_rng(seed)
        num_lines = self.table.shape[0] // LINE_BYTES
        num_batches = max(4, (64 << 20) // (reads_a_call * LINE_BYTES))
        self.batches = [rng.integers(0, num_lines, reads_a_call) * LINE_BYTES
                        for _ in range(num_batches)]
        self.out = np.empty(reads_a_call, np.uint8)
        self.run()

    def run(self) -> None:
        for batch in self.batches:
            np.take(self.table, batch, out=self.out, mode="clip")

    def reads_a_second(self) -> float:
        return len(self.batches) * self.out.shape[0] / best_seconds(self.run, 3)


def measure_gather(shm_name: str, shm_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    """Each round measures memcpy right before the gathers it is compared with, so a
    neighbour's load hits both sides of a ratio alike; the report takes medians."""
    threads = args.threads
    single = SharedTableReader(shm_name, shm_dir=shm_dir)
    parallel = SharedTableReader(shm_name, shm_dir=shm_dir, gather_threads=threads)
    memcpy_1t = MemcpyBaseline(single.table_rows(), 1)
    memcpy_nt = MemcpyBaseline(single.table_rows(), threads)
    loads = {"decode_1t": GatherLoad(single, args.decode_tokens, 1),
             "prefill_1t": GatherLoad(single, args.prefill_tokens, 2),
             "prefill_nt": GatherLoad(parallel, args.prefill_tokens, 3)}
    line_reads = RandomLineReads(single.table_rows(), args.decode_tokens * HEADS, 4)
    rounds: dict[str, list[float]] = {key: [] for key in ("memcpy_1t", "memcpy_nt", *loads)}
    reads_a_second: list[float] = []  # line reads, not GB/s: kept out of `rounds`
    for _ in range(args.rounds):
        rounds["memcpy_1t"].append(memcpy_1t.gb_s())
        reads_a_second.append(line_reads.reads_a_second())
        rounds["decode_1t"].append(loads["decode_1t"].gb_s())
        rounds["prefill_1t"].append(loads["prefill_1t"].gb_s())
        rounds["memcpy_nt"].append(memcpy_nt.gb_s())
        rounds["prefill_nt"].append(loads["prefill_nt"].gb_s())
    results: dict[str, object] = {f"{key}_gb_s": median(values) for key, values in rounds.items()}
    row_bytes = single.header.row_bytes
    results["line_reads_per_s"] = median(reads_a_second)
    # One read a row: the most a gather of random rows could reach, against memcpy.
    results["one_read_a_row_vs_memcpy_1t"] = median(
        [r * row_bytes / 1e9 / m for r, m in zip(reads_a_second, rounds["memcpy_1t"])])
    results["decode_1t_reads_a_row"] = median(
        [r / (g * 1e9 / row_bytes) for r, g in zip(reads_a_second, rounds["decode_1t"])])
    for key, baseline in (("decode_1t", "memcpy_1t"), ("prefill_1t", "memcpy_1t"),
                          ("prefill_nt", "memcpy_nt")):
        results[f"{key}_vs_{baseline}"] = median(
            [g / m for g, m in zip(rounds[key], rounds[baseline])])
        results[f"{key}_vs_machine_memcpy"] = median(
            [g / max(a, b) for g, a, b in zip(rounds[key], rounds["memcpy_1t"], rounds["memcpy_nt"])])
    results["memcpy_bytes"] = memcpy_1t.src.nbytes
    results["table_huge_page_bytes"] = single.huge_page_bytes()
    memcpy_1t.close()
    memcpy_nt.close()
    del loads
    single.close()
    parallel.close()
    return results


# A child process that echoes bytes back over one TCP connection.
_ECHO_CHILD = """
import socket, sys
connection = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while byte := connection.recv(1):
    connection.sendall(byte)
"""


class LoopbackEcho:
    """One byte to a child process and back over loopback TCP: the round trip that any
    RPC between two processes on this machine pays before gRPC does anything."""

    def __init__(self, cpus: set[int]) -> None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            listener.settimeout(60)  # a child that never connects fails the run, not hangs it
            self.child = pinned(subprocess.Popen(
                [sys.executable, "-c", _ECHO_CHILD, str(listener.getsockname()[1])]), cpus)
            self.connection, _ = listener.accept()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trip(self, _: int) -> None:
        self.connection.sendall(b"x")
        self.connection.recv(1)

    def close(self) -> None:
        self.connection.close()
        self.child.wait(timeout=10)


# A child process serving one bidirectional stream whose handler answers every message with
# the same prebuilt bytes (no serializers: bytes in, bytes out), with the service's options
# and its choice of grpc I/O threads.
_BARE_STREAM_CHILD = """
import asyncio, sys
from services.mesh.grpc_io import prefer_polling_thread_io
prefer_polling_thread_io()
import grpc
from services.mesh.channels import GRPC_OPTIONS
reply = bytes(int(sys.argv[2]))
async def answer(requests, context):
    async for _ in requests:
        yield reply
async def serve():
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Bare", {"Stream": grpc.stream_stream_rpc_method_handler(answer)}),))
    server.add_insecure_port(sys.argv[1])
    await server.start()
    await server.wait_for_termination()
asyncio.run(serve())
"""


class BareGrpcStream:
    """A decode step's LookupStream bytes (the request's ids in, the reply's rows out) over a
    grpcio stream to a child process that only answers: grpcio's floor under LookupStream,
    so the difference is the lookup's own cost (parsing, id check, gather, reply)."""

    def __init__(self, request_bytes: int, reply_bytes: int, cpus: set[int]) -> None:
        address = _free_address()
        self.child = pinned(subprocess.Popen(
            [sys.executable, "-c", _BARE_STREAM_CHILD, address, str(reply_bytes)],
            cwd=REPO_ROOT, env=_child_env()), cpus)
        self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.request = bytes(request_bytes)
        self.requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.replies = self.channel.stream_stream("/bench.Bare/Stream")(
            iter(self.requests.get, None))

    def round_trip(self, _: int) -> None:
        self.requests.put(self.request)
        next(self.replies)

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()
        self.child.terminate()
        self.child.wait(timeout=10)


def measure_latency(address: str, shm_name: str, shm_dir: Path,
                    args: argparse.Namespace) -> dict[str, object]:
    """One decode step's lookup through shared memory, over a LookupStream and by unary
    Lookup calls, the same bytes over a bare grpcio stream, an empty gRPC call on the unary
    client's channel and a bare loopback round trip, interleaved round by round; medians
    over rounds."""
    rounds: dict[str, list[float]] = {}
    # Closed however the run ends: the bare stream's child would serve on forever.
    with contextlib.ExitStack() as opened:
        reader = SharedTableReader(shm_name, shm_dir=shm_dir)
        opened.callback(reader.close)
        rng = np.random.default_rng(4)
        steps = [rng.integers(0, reader.header.num_rows, (args.decode_tokens, HEADS))
                 for _ in range(256)]
        out = np.empty((args.decode_tokens, HEADS, reader.header.row_bytes), np.uint8)
        stream_client = PleTableClient(address, allow_shared_memory=False)
        opened.callback(stream_client.close)
        unary_client = PleTableClient(address, allow_shared_memory=False, lookup_stream=False)
        opened.callback(unary_client.close)
        # The children answering the echo and the bare stream run where the service does.
        echo = LoopbackEcho(args.service_cpus)
        opened.callback(echo.close)
        num_ids = args.decode_tokens * HEADS
        bare_stream = BareGrpcStream(
            ple_pb2.LookupRequest(row_ids_le_i64=bytes(8 * num_ids)).ByteSize(),
            ple_pb2.LookupResponse(rows=bytes(num_ids * reader.header.row_bytes),
                                   generation=1).ByteSize(), args.service_cpus)
        opened.callback(bare_stream.close)
        calls: dict[str, Callable[[int], object]] = {
            "shm_step": lambda i: reader.gather(steps[i % len(steps)], out=out),
            "grpc_stream_step": lambda i: stream_client.gather(steps[i % len(steps)]),
            "grpc_step": lambda i: unary_client.gather(steps[i % len(steps)]),
            "bare_stream": bare_stream.round_trip,
            "grpc_empty": lambda i: unary_client.describe(),
            "tcp_echo": echo.round_trip,
        }
        for _ in range(args.rounds):
            for name, call in calls.items():
                p50, p99 = percentiles_ms(call, args.calls)
                rounds.setdefault(f"{name}_p50_ms", []).append(p50)
                rounds.setdefault(f"{name}_p99_ms", []).append(p99)
    return {key: median(values) for key, values in rounds.items()} | {
        f"{key}_rounds": [round(v, 3) for v in values] for key, values in rounds.items()
        if key.endswith("p99_ms")}


def _gpu_seconds(torch: Any, fn: Callable[[], object], repeats: int) -> float:
    """Best GPU time of `fn` over `repeats`, timed with CUDA events. A sleep kernel holds
    the stream while Python queues the work, so launch overhead stays out of the figure:
    it measures what the GPU pulls, not how fast Python launches."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # 0.1 s at 2 GHz: longer than queueing 500 calls
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measure_gpu(shm_name: str, shm_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    import torch

    from services.ple_offload.cuda_table import CudaHostTable, CudaRegistrationError, driver_support

    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)  # the context, before the driver is asked anything
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(device),
                                  "torch": torch.__version__, "driver": driver_support(device)}
    reader = SharedTableReader(shm_name, shm_dir=shm_dir)
    num_rows, row_bytes = reader.header.num_rows, reader.header.row_bytes
    started = time.perf_counter()
    try:
        table: CudaHostTable | None = CudaHostTable(reader, device)
        results["register_s"] = time.perf_counter() - started
    except CudaRegistrationError as exc:
        table = None
        results["registration_refused"] = str(exc)

    pinned = torch.ones(MEMCPY_BYTES, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(MEMCPY_BYTES, dtype=torch.uint8, device=device)
    copy = lambda: on_device.copy_(pinned, non_blocking=True)  # noqa: E731
    copy()
    rng = np.random.default_rng(5)
    gib = 1 << 30
    rounds: dict[str, list[float]] = {}
    if table is not None:
        assert table.rows is not None
        u8_rows = table.rows
        loads: dict[str, tuple[list[torch.Tensor], Callable[[torch.Tensor], object]]] = {}
        for name, tokens, how in (("decode", args.decode_tokens, table.gather),
                                  ("prefill", args.prefill_tokens, table.gather),
                                  ("decode_u8", args.decode_tokens,
                                   lambda ids: torch.index_select(u8_rows, 0, ids.reshape(-1))),
                                  ("prefill_u8", args.prefill_tokens,
                                   lambda ids: torch.index_select(u8_rows, 0, ids.reshape(-1)))):
            # A fresh batch per call, up to 256 MiB of rows (so no row comes from a cache),
            # and at most 500 calls: more launches than the stream queues would block.
            count = min(500, max(4, (256 << 20) // (tokens * HEADS * row_bytes)))
            loads[name] = ([torch.from_numpy(rng.integers(0, num_rows, (tokens, HEADS))).to(device)
                            for _ in range(count)], how)
        first = torch.arange(min(num_rows, gib // row_bytes), device=device)
        loads["sequential"] = ([first], table.gather)
        for batches, how in loads.values():
            how(batches[0])
        torch.cuda.synchronize()
        for _ in range(args.rounds):
            rounds.setdefault("h2d_gb_s", []).append(pinned.nbytes / _gpu_seconds(torch, copy, 5) / 1e9)
            for name, (batches, how) in loads.items():
                seconds = _gpu_seconds(torch, lambda: [how(ids) for ids in batches], 3)  # noqa: B023
                moved = sum(ids.numel() for ids in batches) * row_bytes
                rounds.setdefault(f"{name}_gb_s", []).append(moved / seconds / 1e9)
        for name in loads:
            results[f"{name}_vs_h2d"] = median(
                [g / c for g, c in zip(rounds[f"{name}_gb_s"], rounds["h2d_gb_s"])])
        steps = loads["decode"][0]
        results |= _latency(torch, lambda i: table.gather(steps[i % len(steps)]), args.calls, "gpu_step")
    else:
        rounds["h2d_gb_s"] = [pinned.nbytes / _gpu_seconds(torch, copy, 5) / 1e9
                              for _ in range(args.rounds)]
    results |= {key: median(values) for key, values in rounds.items()}

    # The path the GPU gather replaces: host gather into pinned memory, then a copy.
    host_steps = [rng.integers(0, num_rows, (args.decode_tokens, HEADS)) for _ in range(256)]
    staging = torch.empty((args.decode_tokens, HEADS, row_bytes), dtype=torch.uint8, pin_memory=True)
    step_out = torch.empty_like(staging, device=device)

    def host_step(i: int) -> None:
        reader.gather(host_steps[i % len(host_steps)], out=staging.numpy())
        step_out.copy_(staging, non_blocking=True)

    results |= _latency(torch, host_step, args.calls, "host_step")
    if table is not None:
        table.close()
    reader.close()
    return results


def _latency(torch: Any, step: Callable[[int], object], calls: int, key: str) -> dict[str, float]:
    """p50/p99 of one call until its rows are on the device (host clock, launch and
    synchronize included), after a warm-up."""
    for i in range(max(50, calls // 10)):
        step(i)
    torch.cuda.synchronize()
    samples = np.empty(calls)
    for i in range(calls):
        started = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        samples[i] = time.perf_counter() - started
    return {f"{key}_p50_ms": float(np.percentile(samples, 50) * 1e3),
            f"{key}_p99_ms": float(np.percentile(samples, 99) * 1e3)}


def report_gpu(results: dict[str, object], args: argparse.Namespace, table_gib: float) -> None:
    r = results
    print(f"{r['gpu']}, torch {r['torch']}, driver {r['driver']}; {os.cpu_count()} CPUs, "
          f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"table {table_gib:.2f} GiB of {args.row_bytes} B rows in {args.shm_dir}, {HEADS} rows per token")
    print(f"pinned host -> device copy ({MEMCPY_BYTES >> 20} MiB, best of 5, median of "
          f"{args.rounds} rounds): {r['h2d_gb_s']:.2f} GB/s")
    if "registration_refused" in r:
        print(f"GPU gather unavailable: {r['registration_refused']}")
    else:
        print(f"registered the shared table with CUDA in {r['register_s']:.2f} s")
        print(f"{'GPU gather from the shared table':42s} {'GB/s':>7s} {'pinned H2D':>11s} {'ratio':>6s}")
        for key, label in (
                ("decode", f"decode {args.decode_tokens}x{HEADS} (8-byte words)"),
                ("prefill", f"prefill {args.prefill_tokens}x{HEADS} (8-byte words)"),
                ("decode_u8", f"decode {args.decode_tokens}x{HEADS}, uint8 elements"),
                ("prefill_u8", f"prefill {args.prefill_tokens}x{HEADS}, uint8 elements"),
                ("sequential", "first 1 GiB of rows in order")):
            print(f"{label:42s} {r[f'{key}_gb_s']:7.2f} {r['h2d_gb_s']:11.2f} {r[f'{key}_vs_h2d']:6.2f}")
        print(f"decode step {args.decode_tokens}x{HEADS}, GPU gather, to rows on the device: "
              f"p50 {r['gpu_step_p50_ms']:.3f} ms, p99 {r['gpu_step_p99_ms']:.3f} ms")
    print(f"decode step {args.decode_tokens}x{HEADS}, host gather + pinned copy (for comparison): "
          f"p50 {r['host_step_p50_ms']:.3f} ms, p99 {r['host_step_p99_ms']:.3f} ms")
    print(json.dumps(results))


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def report(results: dict[str, object], args: argparse.Namespace, table_gib: float) -> None:
    n = args.threads
    r = results
    print(f"machine: {os.cpu_count()} CPUs; load average (1/5/15 min) before "
          f"{'/'.join(f'{x:.2f}' for x in r['load_before'])}, after "
          f"{'/'.join(f'{x:.2f}' for x in r['load_after'])}")
    print(f"table {table_gib:.2f} GiB of {args.row_bytes} B rows in {args.shm_dir}, {HEADS} rows "
          f"per token; {r['table_huge_page_bytes'] / 2**30:.2f} GiB of it in huge pages")
    print(f"CPUs: service {_cpu_list(args.service_cpus)}, clients {_cpu_list(os.sched_getaffinity(0))}")
    # The service and the bare stream's server set this themselves unless it is given.
    print(f"{GRPC_EXPERIMENTS_ENV}: service "
          f"{os.environ.get(GRPC_EXPERIMENTS_ENV, POLLING_THREAD_IO)!r}, clients "
          f"{os.environ.get(GRPC_EXPERIMENTS_ENV, '(unset: grpcio default)')!r}")
    print(f"memcpy baseline: {r['memcpy_bytes'] / 2**20:.0f} MiB contiguous copy out of the table, "
          f"best of 5: "
          f"{r['memcpy_1t_gb_s']:.2f} GB/s with 1 thread, {r['memcpy_nt_gb_s']:.2f} GB/s with "
          f"{n}; medians of {args.rounds} rounds")
    print(f"{'shm gather (random rows)':30s} {'GB/s':>7s} {'memcpy same threads':>20s} "
          f"{'ratio':>6s} {'vs best memcpy':>15s}")
    for key, label, baseline in (
            ("decode_1t", f"decode {args.decode_tokens}x{HEADS}, 1 thread", "memcpy_1t"),
            ("prefill_1t", f"prefill {args.prefill_tokens}x{HEADS}, 1 thread", "memcpy_1t"),
            ("prefill_nt", f"prefill {args.prefill_tokens}x{HEADS}, {n} threads", "memcpy_nt")):
        print(f"{label:30s} {r[f'{key}_gb_s']:7.2f} {r[f'{baseline}_gb_s']:20.2f} "
              f"{r[f'{key}_vs_{baseline}']:6.2f} {r[f'{key}_vs_machine_memcpy']:15.2f}")
    print(f"random 64-byte line reads, 1 thread, {args.decode_tokens * HEADS} a call: "
          f"{r['line_reads_per_s'] / 1e6:.1f} M/s. At one read a row a gather would reach "
          f"{r['one_read_a_row_vs_memcpy_1t']:.2f} x memcpy; the decode gather takes "
          f"{r['decode_1t_reads_a_row']:.2f} reads' time a row")
    step = f"{args.decode_tokens}x{HEADS}"
    print(f"decode step {step}, medians over {args.rounds} rounds of {args.calls} calls:")
    for key, label in (("shm_step", "shm lookup"),
                       ("grpc_stream_step", "gRPC LookupStream (loopback)"),
                       ("grpc_step", "gRPC unary Lookup (loopback)"),
                       ("bare_stream", "bare grpcio stream, same bytes"),
                       ("grpc_empty", "empty gRPC call (Describe)"),
                       ("tcp_echo", "1-byte TCP echo, 2 processes")):
        print(f"  {label:30s} p50 {r[f'{key}_p50_ms']:.3f} ms, p99 {r[f'{key}_p99_ms']:.3f} ms")
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-gib", type=float, default=2.0)
    parser.add_argument("--row-bytes", type=int, default=160)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000, help="latency calls per round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="measurement rounds; figures are medians over rounds")
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1),
                        help="threads for the parallel gather and memcpy")
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"),
                        help="tmpfs for the table (one mounted with huge=within_size: huge pages)")
    parser.add_argument("--service-cpus", type=cpu_set,
                        help="CPUs for the service (and the echo and bare-stream children), "
                        "e.g. 2 or 2-3; default: all this process may use")
    parser.add_argument("--client-cpus", type=cpu_set,
                        help="CPUs for this process (the clients and the gathers), e.g. 3")
    parser.add_argument("--gpu", action="store_true",
                        help="measure GPU gathers from the registered shared table instead")
    args = parser.parse_args()
    # SIGTERM ends the run like Ctrl-C, so the service and the table it holds in shared
    # memory are stopped and removed too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.service_cpus is None:
        args.service_cpus = os.sched_getaffinity(0)  # before --client-cpus narrows it
    if args.client_cpus is not None:
        # Before grpc starts a thread, so that its threads inherit it too.
        os.sched_setaffinity(0, args.client_cpus)
    num_rows = int(args.table_gib * 2**30) // args.row_bytes
    shm_name = f"backport-ple-bench-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "table.safetensors"
        write_table(table, num_rows, args.row_bytes)
        process, address = start_service(table, shm_name, args.shm_dir, args.service_cpus)
        try:
            if args.gpu:
                report_gpu(measure_gpu(shm_name, args.shm_dir, args), args,
                           num_rows * args.row_bytes / 2**30)
                return
            results: dict[str, object] = {"threads": args.threads,
                                          "load_before": os.getloadavg()}
            results |= measure_gather(shm_name, args.shm_dir, args)
            results |= measure_latency(address, shm_name, args.shm_dir, args)
            results["load_after"] = os.getloadavg()
            report(results, args, num_rows * args.row_bytes / 2**30)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


if __name__ == "__main__":
    main()
