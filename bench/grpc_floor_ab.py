"""Why a grpcio round trip costs 0.35-0.6 ms on a VM host where a TCP echo costs 0.02 ms:
grpc settings, placement and idle CPUs, A/B in one run (docs/ple.md, "grpcio's floor").

    python3 bench/grpc_floor_ab.py [--set first|split] [--rounds 5] [--calls 2000] [--out r.json]

Each variant is a server process and a client process that stay up for the whole run. The
client answers commands on stdin, so the variants are measured in turns, round by round,
and only figures of the same run are compared. "bare" variants run bench/ple.py's bare
stream (8 KiB in, 160 KiB prebuilt reply out, bytes both ways); "ple" variants run the
PLE service's LookupStream (PleTableClient, 64x16 random rows of a 1 GiB table). Variants
differ in grpc's environment (both processes, or the client's apart: --set split),
channel/server options (bare only),
address (TCP loopback or a unix socket) and CPU placement. "spin" variants keep every
CPU busy with SCHED_IDLE loops, so no CPU halts while the round trip waits: the cost
that idle CPUs add. For each variant the driver also counts context switches, CPU time
and run-queue delay per round trip, per thread name, from /proc. A first phase measures
a pipe ping-pong between two processes after idle gaps of 0-1 ms. The table ends with each
variant's p50 over the p50 of the set's first variant (grpc as it comes), the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "protos")]

from services.mesh.grpc_io import GRPC_EXPERIMENTS_ENV, POLLING_THREAD_IO  # noqa: E402

REQUEST_BYTES = 8 * 1024 + 4  # a LookupRequest of 1024 ids
REPLY_BYTES = 1024 * 160 + 13  # a LookupResponse of 1024 rows of 160 B
ROW_BYTES = 160
# grpc core's socket I/O on its polling threads (iomgr), as the PLE service now asks for.
IOMGR = {GRPC_EXPERIMENTS_ENV: POLLING_THREAD_IO}
# Names an experiment that grpcio 1.85 has on by default, so grpc keeps its EventEngine
# I/O threads, and the PLE service keeps them too instead of choosing polling-thread I/O.
EVENT_ENGINE = {GRPC_EXPERIMENTS_ENV: "event_engine_client"}


@dataclass
class Variant:
    name: str
    kind: str  # "bare" or "ple"
    env: dict[str, str] = field(default_factory=dict)  # both processes
    client_env: dict[str, str] | None = None  # the client's, where it differs
    options: list[tuple[str, Any]] = field(default_factory=list)
    unix_socket: bool = False
    server_cpus: set[int] | None = None
    client_cpus: set[int] | None = None
    spin: bool = False


def _siblings(cpu: int) -> set[int]:
    from ple import cpu_set  # bench/ple.py imports grpc: not before the ping-pong (main)

    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    return cpu_set(path.read_text().strip()) if path.exists() else {cpu}


def _placement() -> tuple[int, int, list[int]]:
    """The server's CPU; the client's CPU for "both pinned" (another core, the case that
    matters on a host without SMT); the server CPU's SMT siblings, if any."""
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = cpus[2 % len(cpus)]
    other_core = [c for c in cpus if c not in _siblings(server_cpu)
                  and c not in _siblings(cpus[0])]
    apart = other_core[len(other_core) // 2] if other_core else cpus[-1]
    return server_cpu, apart, sorted(_siblings(server_cpu) - {server_cpu})


def first_set() -> list[Variant]:
    """grpc's knobs, placement and idle CPUs, each side alike. The PLE service gets
    EventEngine I/O unless a variant says otherwise (it now asks for polling-thread I/O
    itself), so "ple" is the service as it was."""
    server_cpu, apart, sibling = _placement()
    env_knobs = {"poll": {"GRPC_POLL_STRATEGY": "poll"},
                 "iomgr": IOMGR,
                 "rcv_lowat": {"GRPC_EXPERIMENTS": "tcp_rcv_lowat"},
                 "frame_tuning": {"GRPC_EXPERIMENTS": "tcp_frame_size_tuning"},
                 "fork0": {"GRPC_ENABLE_FORK_SUPPORT": "0"}}
    chunk = 256 * 1024
    out = [Variant("bare", "bare")]
    out += [Variant(f"bare {name}", "bare", env=env) for name, env in env_knobs.items()]
    out += [
        Variant("bare max_frame 16M", "bare", options=[("grpc.http2.max_frame_size", 16_777_215)]),
        Variant("bare lookahead 4M", "bare", options=[("grpc.http2.lookahead_bytes", 4 << 20)]),
        Variant("bare bdp_probe 0", "bare", options=[("grpc.http2.bdp_probe", 0)]),
        Variant("bare read_chunk 256K", "bare", options=[
            ("grpc.experimental.tcp_read_chunk_size", chunk),
            ("grpc.experimental.tcp_min_read_chunk_size", chunk),
            ("grpc.experimental.tcp_max_read_chunk_size", 4 * chunk)]),
        Variant("bare latency+minimal_stack", "bare", options=[
            ("grpc.optimization_target", "latency"), ("grpc.minimal_stack", 1),
            ("grpc.so_reuseport", 0)]),
        Variant("bare unix socket", "bare", unix_socket=True),
        Variant(f"bare server cpu {server_cpu}", "bare", server_cpus={server_cpu}),
        Variant(f"bare iomgr, server cpu {server_cpu}", "bare", env=IOMGR,
                server_cpus={server_cpu}),
        Variant(f"bare server cpu {server_cpu}, client {apart}", "bare",
                server_cpus={server_cpu}, client_cpus={apart}),
        Variant(f"bare both cpu {server_cpu}", "bare", server_cpus={server_cpu},
                client_cpus={server_cpu}),
        Variant("bare spin", "bare", spin=True),
        Variant("bare iomgr, spin", "bare", env=IOMGR, spin=True),
        Variant(f"bare server cpu {server_cpu}, spin", "bare", server_cpus={server_cpu}, spin=True),
    ]
    if sibling:
        out.append(Variant(f"bare server cpu {server_cpu}, client {sibling[0]} (SMT sibling)",
                           "bare", server_cpus={server_cpu}, client_cpus={sibling[0]}))
    ple = [
        Variant("ple", "ple"),
        Variant("ple iomgr", "ple", env=IOMGR),
        Variant("ple rcv_lowat", "ple", env=env_knobs["rcv_lowat"]),
        Variant(f"ple service cpu {server_cpu}", "ple", server_cpus={server_cpu}),
        Variant(f"ple iomgr, service cpu {server_cpu}", "ple", env=IOMGR,
                server_cpus={server_cpu}),
        Variant(f"ple service cpu {server_cpu}, client {apart}", "ple",
                server_cpus={server_cpu}, client_cpus={apart}),
        Variant(f"ple iomgr, service cpu {server_cpu}, client {apart}", "ple", env=IOMGR,
                server_cpus={server_cpu}, client_cpus={apart}),
        Variant("ple spin", "ple", spin=True),
        Variant("ple iomgr, spin", "ple", env=IOMGR, spin=True),
    ]
    for variant in ple:
        variant.env = EVENT_ENGINE | variant.env
    return out + ple


def split_set() -> list[Variant]:
    """Which side's I/O threads matter: polling-thread I/O (iomgr) on the server only, the
    client only, or both; the PLE service as shipped (iomgr unless told otherwise)."""
    server_cpu, apart, _ = _placement()
    return [
        Variant("bare EE/EE", "bare"),
        Variant("bare server iomgr, client EE", "bare", env=IOMGR, client_env={}),
        Variant("bare server EE, client iomgr", "bare", client_env=IOMGR),
        Variant("bare iomgr/iomgr", "bare", env=IOMGR),
        Variant("ple service EE, client EE (before)", "ple", env=EVENT_ENGINE, client_env={}),
        Variant("ple service iomgr, client EE (shipped)", "ple"),
        Variant("ple service EE, client iomgr", "ple", env=EVENT_ENGINE, client_env=IOMGR),
        Variant("ple service iomgr, client iomgr", "ple", env=IOMGR),
        Variant(f"ple shipped, service cpu {server_cpu}", "ple", server_cpus={server_cpu}),
        Variant(f"ple shipped, service cpu {server_cpu}, client {apart}", "ple",
                server_cpus={server_cpu}, client_cpus={apart}),
        Variant(f"ple iomgr/iomgr, service cpu {server_cpu}, client {apart}", "ple", env=IOMGR,
                server_cpus={server_cpu}, client_cpus={apart}),
    ]


# ---- child processes -------------------------------------------------------------------

def serve_bare(address: str, options: list[tuple[str, Any]]) -> None:
    import asyncio

    import grpc

    from services.mesh.channels import GRPC_OPTIONS
    reply = bytes(REPLY_BYTES)

    async def answer(requests: Any, context: Any) -> Any:
        async for _ in requests:
            yield reply

    async def serve() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS + options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Bare", {"Stream": grpc.stream_stream_rpc_method_handler(answer)}),))
        server.add_insecure_port(address)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


def run_client(kind: str, address: str, options: list[tuple[str, Any]], num_rows: int) -> None:
    """Answers "warm N" and "run N" on stdin; "run" prints p50/p99 and the samples' ms."""
    if kind == "bare":
        import queue

        import grpc

        from services.mesh.channels import GRPC_OPTIONS
        channel = grpc.insecure_channel(address, options=GRPC_OPTIONS + options)
        grpc.channel_ready_future(channel).result(timeout=60)
        requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        replies = channel.stream_stream("/bench.Bare/Stream")(iter(requests.get, None))
        request = bytes(REQUEST_BYTES)

        def round_trip(_: int) -> None:
            requests.put(request)
            next(replies)
    else:
        from services.ple_offload.client import PleTableClient
        client = PleTableClient(address, allow_shared_memory=False, connect_timeout_s=120)
        rng = np.random.default_rng(4)
        steps = [rng.integers(0, num_rows, (64, 16)) for _ in range(256)]

        def round_trip(i: int) -> None:
            client.gather(steps[i % len(steps)])

    print("ready", flush=True)
    for line in sys.stdin:
        verb, count = line.split()
        samples = np.empty(int(count))
        for i in range(int(count)):
            started = time.perf_counter()
            round_trip(i)
            samples[i] = time.perf_counter() - started
        if verb == "run":
            ms = samples * 1e3
            print(json.dumps({"p50": float(np.percentile(ms, 50)),
                              "p99": float(np.percentile(ms, 99))}), flush=True)
        else:
            print("warm", flush=True)


def ping_pong_child() -> None:
    """Echoes each byte from stdin back on stdout (the other end of the ping-pong)."""
    while byte := os.read(0, 1):
        os.write(1, byte)


# ---- driver ----------------------------------------------------------------------------

def child_env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "protos"),
                            os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **extra)


def thread_counters(pid: int) -> dict[str, list[float]]:
    """Per thread name: [voluntary switches, involuntary switches, CPU s, run-queue wait s]."""
    totals: dict[str, list[float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            status = (task / "status").read_text().splitlines()
            run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        fields = {k: v.strip() for k, _, v in (line.partition(":") for line in status)}
        row = totals.setdefault(comm, [0.0, 0.0, 0.0, 0.0])
        row[0] += int(fields["voluntary_ctxt_switches"])
        row[1] += int(fields["nonvoluntary_ctxt_switches"])
        row[2] += int(run_ns) / 1e9
        row[3] += int(wait_ns) / 1e9
    return totals


def counter_delta(before: dict[str, list[float]], after: dict[str, list[float]],
                  calls: int) -> dict[str, list[float]]:
    return {name: [round((a - before.get(name, [0.0] * 4)[i]) / calls * (1 if i < 2 else 1e3), 4)
                   for i, a in enumerate(row)]
            for name, row in after.items()}


def totals(per_thread: dict[str, list[float]]) -> list[float]:
    return [round(sum(row[i] for row in per_thread.values()), 4) for i in range(4)]


class Pair:
    """One variant's server and client processes."""

    def __init__(self, variant: Variant, table: Path, num_rows: int, tmp: Path,
                 index: int) -> None:
        self.variant = variant
        env = child_env(variant.env)
        client_env = env if variant.client_env is None else child_env(variant.client_env)
        opts = json.dumps(variant.options)
        if variant.unix_socket:
            address = f"unix:{tmp}/ab-{index}.sock"
        else:
            address = f"127.0.0.1:{_free_port()}"
        if variant.kind == "bare":
            self.server = subprocess.Popen(
                [sys.executable, __file__, "--serve-bare", address, opts],
                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
            if variant.server_cpus:
                os.sched_setaffinity(self.server.pid, variant.server_cpus)
        else:
            cpu_flags = [a for c in sorted(variant.server_cpus or ()) for a in ("--cpus", str(c))]
            self.server = subprocess.Popen(
                [sys.executable, "-m", "services.ple_offload", "--table-path", str(table),
                 "--address", address, "--shm-name", f"ab-floor-{os.getpid()}-{index}",
                 "--no-show-progress", *cpu_flags], cwd=REPO_ROOT, env=env,
                stdout=subprocess.DEVNULL)
        self.client = subprocess.Popen(
            [sys.executable, __file__, "--client", variant.kind, address, opts,
             str(num_rows)],
            cwd=REPO_ROOT, env=client_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        if variant.client_cpus:
            os.sched_setaffinity(self.client.pid, variant.client_cpus)

    def wait_ready(self) -> None:
        if self.variant.kind == "bare":
            assert self.server.stdout is not None
            _expect(self.server.stdout.readline(), "ready", self.variant.name)
        assert self.client.stdout is not None
        _expect(self.client.stdout.readline(), "ready", self.variant.name)

    def command(self, line: str) -> str:
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(line + "\n")
        self.client.stdin.flush()
        return self.client.stdout.readline()

    def close(self) -> None:
        """The client ends at the end of its input, the server on SIGTERM; either is
        killed if it does not (a run stopped before the pair was ready)."""
        if self.client.stdin is not None:
            self.client.stdin.close()
        _wait_or_kill(self.client, 30)
        self.server.send_signal(signal.SIGTERM)
        _wait_or_kill(self.server, 60)


def _wait_or_kill(process: subprocess.Popen[Any], timeout_s: float) -> None:
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _expect(line: str, word: str, name: str) -> None:
    if line.strip() != word:
        raise SystemExit(f"{name}: expected {word!r}, got {line!r}")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Spinners:
    """A SCHED_IDLE busy loop on each CPU, stopped (SIGSTOP) unless a variant asks for it.
    They run only when nothing else wants the CPU, so they keep idle CPUs from halting."""

    _LOOP = ("import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
             "while True:\n    pass\n")

    def __init__(self) -> None:
        self.processes = []
        for cpu in sorted(os.sched_getaffinity(0)):
            process = subprocess.Popen([sys.executable, "-c", self._LOOP])
            os.sched_setaffinity(process.pid, {cpu})
            self.processes.append(process)
        time.sleep(0.5)
        self.set_running(False)

    def set_running(self, running: bool) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGCONT if running else signal.SIGSTOP)

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def ping_pong(gaps_ms: list[float], calls: int, spinners: Spinners) -> dict[str, Any]:
    """A 1-byte round trip over pipes to another process, after an idle gap (sleep) of
    each length: how a wake-up's cost grows with how long the CPUs were idle."""
    child = subprocess.Popen([sys.executable, __file__, "--ping-pong-child"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    to_child, from_child = child.stdin.fileno(), child.stdout.fileno()
    results: dict[str, Any] = {}
    for spin in (False, True):
        spinners.set_running(spin)
        for gap_ms in gaps_ms:
            samples = np.empty(calls)
            for i in range(calls):
                if gap_ms:
                    time.sleep(gap_ms / 1e3)
                started = time.perf_counter()
                os.write(to_child, b"x")
                os.read(from_child, 1)
                samples[i] = time.perf_counter() - started
            ms = samples * 1e3
            results[f"gap {gap_ms} ms{', spin' if spin else ''}"] = {
                "p50": round(float(np.percentile(ms, 50)), 4),
                "p99": round(float(np.percentile(ms, 99)), 4)}
    spinners.set_running(False)
    child.stdin.close()
    child.wait(10)
    return results


def machine_facts() -> dict[str, str]:
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            return f"({exc.__class__.__name__})"

    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"({exc.__class__.__name__})"

    import grpc
    return {"lscpu_e": run("lscpu", "-e"), "lscpu": run("lscpu"),
            "cmdline": read("/proc/cmdline"), "kernel": run("uname", "-r"),
            "cpuidle_driver": read("/sys/devices/system/cpu/cpuidle/current_driver"),
            "cpuidle_governor": read("/sys/devices/system/cpu/cpuidle/current_governor_ro"),
            "clocksource": read("/sys/devices/system/clocksource/clocksource0/current_clocksource"),
            "haltpoll": run("sh", "-c", "ls /sys/module | grep -i -E 'haltpoll|kvm' || true"),
            "sched_features": read("/sys/kernel/debug/sched/features"),
            "grpcio": grpc.__version__, "python": sys.version.split()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warm", type=int, default=200)
    parser.add_argument("--table-gib", type=float, default=1.0,
                        help="table size of each ple variant's own service")
    parser.add_argument("--ping-pong-calls", type=int, default=1000)
    parser.add_argument("--set", choices=("first", "split"), default="first",
                        help="first: grpc's knobs and placement; split: which side's I/O matters")
    parser.add_argument("--only", help="run only variants whose name contains this")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="start no new round after this many seconds")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # SIGTERM ends the run like Ctrl-C, so the pairs and spinners it started are stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.monotonic()
    results: dict[str, Any] = {"facts": machine_facts(), "load_before": os.getloadavg()}
    print(results["facts"]["lscpu_e"], flush=True)

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))

    spinners = Spinners()
    pairs: list[Pair] = []
    try:
        results["ping_pong"] = ping_pong([0, 0.05, 0.2, 0.5, 1.0], args.ping_pong_calls, spinners)
        for key, value in results["ping_pong"].items():
            print(f"pipe ping-pong, {key}: p50 {value['p50']:.3f} p99 {value['p99']:.3f} ms",
                  flush=True)
        save()
        chosen = [v for v in (first_set() if args.set == "first" else split_set())
                  if not args.only or args.only in v.name]
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            table = tmp / "table.safetensors"
            sys.path.insert(0, str(REPO_ROOT / "bench"))
            from ple import write_table
            num_rows = int(args.table_gib * 2**30) // ROW_BYTES
            write_table(table, num_rows, ROW_BYTES)
            for index, variant in enumerate(chosen):  # each one kept for `finally` at once
                pairs.append(Pair(variant, table, num_rows, tmp, index))
            for pair in pairs:
                pair.wait_ready()
            rounds: dict[str, list[dict[str, Any]]] = {v.name: [] for v in chosen}
            results["rounds"] = rounds
            for round_index in range(args.rounds):
                if time.monotonic() - started > args.budget_s:
                    print(f"budget spent: stopped after {round_index} rounds", flush=True)
                    break
                for pair in pairs:
                    spinners.set_running(pair.variant.spin)
                    _expect(pair.command(f"warm {args.warm}"), "warm", pair.variant.name)
                    server_before = thread_counters(pair.server.pid)
                    client_before = thread_counters(pair.client.pid)
                    figures = json.loads(pair.command(f"run {args.calls}"))
                    server_per_rt = counter_delta(server_before, thread_counters(pair.server.pid),
                                                  args.calls)
                    client_per_rt = counter_delta(client_before, thread_counters(pair.client.pid),
                                                  args.calls)
                    spinners.set_running(False)
                    rounds[pair.variant.name].append(
                        figures | {"server": totals(server_per_rt), "client": totals(client_per_rt),
                                   "server_threads": server_per_rt,
                                   "client_threads": client_per_rt})
                print(f"round {round_index + 1} done", flush=True)
                save()
    finally:
        for pair in pairs:
            pair.close()
        spinners.close()
    results["load_after"] = os.getloadavg()
    summary = {}
    for name, per_round in rounds.items():
        if not per_round:
            continue
        summary[name] = {
            "p50": round(median(r["p50"] for r in per_round), 3),
            "p99": round(median(r["p99"] for r in per_round), 3),
            "p99_rounds": [round(r["p99"], 3) for r in per_round],
            # [voluntary, involuntary switches, CPU ms, run-queue wait ms] per round trip
            "server": [round(median(r["server"][i] for r in per_round), 3) for i in range(4)],
            "client": [round(median(r["client"][i] for r in per_round), 3) for i in range(4)]}
    # The set's first variant is its baseline: grpc and the service as they come.
    baseline = next(iter(summary), None)
    for s in summary.values():
        s["p50_vs_baseline"] = round(s["p50"] / summary[baseline]["p50"], 3)
    results["summary"] = summary
    results["baseline"] = baseline
    save()
    print(f"variant | p50 ms | p50 vs {baseline} | p99 ms | p99 per round | server vol/invol "
          "switches, CPU ms, wait ms per round trip | client same")
    for name, s in summary.items():
        print(f"{name} | {s['p50']:.3f} | {s['p50_vs_baseline']:.2f} | {s['p99']:.3f} | "
              f"{s['p99_rounds']} | {s['server']} | {s['client']}")


def _dispatch() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ping-pong-child":
        ping_pong_child()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-bare":
        serve_bare(sys.argv[2], [tuple(o) for o in json.loads(sys.argv[3])])
    elif len(sys.argv) > 1 and sys.argv[1] == "--client":
        run_client(sys.argv[2], sys.argv[3], [tuple(o) for o in json.loads(sys.argv[4])],
                   int(sys.argv[5]))
    else:
        main()


if __name__ == "__main__":
    _dispatch()
