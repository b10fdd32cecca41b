"""The CPU benchmarks run in their quickest mode: each exits 0, prints its ratios against
the baseline of the same run, and leaves no process, shared-memory segment or temporary
file behind, also when stopped by SIGTERM. No timing is asserted: on CI's two cores the
figures mean nothing. The benchmarks that start vLLM engines (kvcache, routing,
gateway_overhead) take minutes each and are not run here; kernels.py needs a CUDA card."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")
RUN_TIMEOUT_S = 120.0
LEFTOVER_GRACE_S = 10.0
# Every process a run starts inherits this variable: how the leftovers of a run are found.
RUN_MARKER_ENV = "BACKPORT_BENCH_SMOKE_RUN"

PLE_QUICK = ["bench/ple.py", "--table-gib", "0.05", "--threads", "2", "--rounds", "1",
             "--calls", "100"]
CEILING_QUICK = ["bench/gateway_ceiling.py", "--concurrency", "2", "--max-tokens", "16",
                 "--rounds", "1"]
AB_QUICK = ["bench/grpc_floor_ab.py", "--set", "split", "--rounds", "1", "--calls", "50",
            "--warm", "10", "--ping-pong-calls", "20", "--table-gib", "0.01"]


@dataclass
class BenchRun:
    returncode: int
    stdout: str
    leftover_processes: list[str]
    leftover_segments: list[str]
    leftover_temp_files: list[str]


def _marked_processes(marker: str) -> dict[int, str]:
    """Command lines, by pid, of the live processes whose environment carries `marker`."""
    needle = f"{RUN_MARKER_ENV}={marker}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
    return found


def _segments_of(pid: int) -> list[str]:
    """Shared-memory segments a bench names after its pid (its PLE tables)."""
    return sorted(p.name for p in SHM_DIR.iterdir() if re.search(rf"-{pid}(-|$)", p.name))


def _temp_dir(output: Path) -> Path:
    """The bench's TMPDIR: beside its output, empty until the bench writes there."""
    return output.with_suffix(".tmp")


def _finish(process: subprocess.Popen[bytes], marker: str, output: Path) -> BenchRun:
    """The run's result and what it left behind: anything still there after a grace period
    (children stopping) is a leak, killed here so that a failing test leaks nothing."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (_marked_processes(marker) or _segments_of(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.25)
    leftovers = _marked_processes(marker)
    segments = _segments_of(process.pid)
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    for name in segments:
        (SHM_DIR / name).unlink(missing_ok=True)
    return BenchRun(process.returncode, output.read_text(errors="replace"),
                    list(leftovers.values()), segments,
                    sorted(p.name for p in _temp_dir(output).iterdir()))


def _start(args: list[str], marker: str, output: Path) -> subprocess.Popen[bytes]:
    """The bench with its output in a file: a leaked child holding a pipe would hang the test."""
    _temp_dir(output).mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(_temp_dir(output)),
               **{RUN_MARKER_ENV: marker})
    with output.open("wb") as sink:
        return subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=env,
                                stdout=sink, stderr=subprocess.STDOUT)


def run_bench(args: list[str], output: Path) -> BenchRun:
    marker = uuid.uuid4().hex
    process = _start(args, marker, output)
    process.wait(timeout=RUN_TIMEOUT_S)
    return _finish(process, marker, output)


def terminate_bench(args: list[str], started_line: str, output: Path) -> BenchRun:
    """Runs a bench until it prints a line containing `started_line`, then sends SIGTERM."""
    marker = uuid.uuid4().hex
    process = _start(args, marker, output)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while started_line not in output.read_text(errors="replace"):
        assert process.poll() is None, f"ended before {started_line!r}:\n{output.read_text()}"
        assert time.monotonic() < deadline, f"no {started_line!r} in {RUN_TIMEOUT_S} s"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=RUN_TIMEOUT_S)
    return _finish(process, marker, output)


def assert_clean_exit(run: BenchRun) -> None:
    assert run.returncode == 0, run.stdout[-4000:]
    assert run.leftover_processes == []
    assert run.leftover_segments == []
    assert run.leftover_temp_files == []


def test_ple_bench_prints_gathers_against_memcpy_of_the_same_run(tmp_path: Path) -> None:
    run = run_bench(PLE_QUICK, tmp_path / "ple.log")
    assert_clean_exit(run)
    # The baseline names the bytes it copied: the whole table when it is under 1 GiB.
    table_mib = round(int(0.05 * 2**30) // 160 * 160 / 2**20)
    assert f"memcpy baseline: {table_mib} MiB contiguous copy" in run.stdout
    number = r"\d+\.\d+"
    for label in ("decode 64x16, 1 thread", "prefill 4096x16, 1 thread",
                  "prefill 4096x16, 2 threads"):
        # GB/s, the memcpy of the same threads, the ratio, the ratio against the best memcpy
        assert re.search(rf"^{label}\s+{number}\s+{number}\s+{number}\s+{number}$",
                         run.stdout, re.MULTILINE), run.stdout
    for label in ("shm lookup", "gRPC LookupStream (loopback)", "bare grpcio stream, same bytes",
                  "1-byte TCP echo, 2 processes"):
        assert re.search(rf"{re.escape(label)}\s+p50 {number} ms, p99 {number} ms", run.stdout)


def test_grpc_floor_ab_prints_each_variant_against_the_first(tmp_path: Path) -> None:
    run = run_bench(AB_QUICK, tmp_path / "ab.log")
    assert_clean_exit(run)
    assert "pipe ping-pong, gap 0 ms: p50" in run.stdout
    table = run.stdout[run.stdout.index("variant | p50 ms"):].splitlines()
    assert "p50 vs bare EE/EE" in table[0]
    rows = [line.split(" | ") for line in table[1:] if " | " in line]
    assert [row[0] for row in rows][:2] == ["bare EE/EE", "bare server iomgr, client EE"]
    assert len(rows) == 11
    ratio_column = table[0].split(" | ").index("p50 vs bare EE/EE")
    assert rows[0][ratio_column] == "1.00"
    assert all(re.fullmatch(r"\d+\.\d\d", row[ratio_column]) for row in rows)


def test_gateway_ceiling_prints_the_gateway_against_the_engine_read_directly(tmp_path: Path) -> None:
    run = run_bench(CEILING_QUICK, tmp_path / "ceiling.log")
    assert_clean_exit(run)
    # Streams, tokens a second direct and through the gateway, their ratio, CPU a token.
    assert re.search(r"^\s+2\s+\d+\s+\d+\s+\d+\.\d{3}\s+\d+\s+\d+$", run.stdout,
                     re.MULTILINE), run.stdout


@pytest.mark.parametrize(("args", "started_line"), [
    # The service's log line: the bench is measuring, its service holding the table.
    pytest.param([*PLE_QUICK[:-1], "100000"], "PleOffload listening", id="ple"),
    # Every pair of processes is up once a round is done.
    pytest.param([*AB_QUICK[:4], "100", *AB_QUICK[5:]], "round 1 done", id="grpc_floor_ab"),
    # The table's head: the services are up and the rounds begin.
    pytest.param([*CEILING_QUICK[:4], "100000", *CEILING_QUICK[5:]], "direct tok/s",
                 id="gateway_ceiling"),
])
def test_sigterm_stops_the_bench_and_everything_it_started(args: list[str], started_line: str,
                                                            tmp_path: Path) -> None:
    run = terminate_bench(args, started_line, tmp_path / "bench.log")
    assert run.returncode != 0
    assert run.leftover_processes == []
    assert run.leftover_segments == []
    assert run.leftover_temp_files == []


@pytest.mark.parametrize("bench", ["bench/kernels.py", "bench/decode_sass.py"])
def test_gpu_benches_import_and_parse_their_flags_without_a_card(bench: str) -> None:
    done = subprocess.run([sys.executable, bench, "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")


def test_kernels_bench_without_a_card_says_it_needs_one() -> None:
    # No card visible, also on a machine with one: the bench must stop before any work.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "bench/kernels.py", "--gpu-arch", "sm80", "--quick"],
                          cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 1
    assert done.stderr.strip().endswith("bench/kernels.py needs a CUDA card")
