"""The PLE hook's client runs inside vLLM's processes, below an engine service whose grpc does
its I/O on polling threads (services/mesh/grpc_io.py). In a child forked from such a process no
gRPC call completes; so where the hook is on, the engine has vLLM spawn its processes.
Real parts: a PLE service, vLLM's own choice of multiprocessing context, a gRPC aio server in
the parent (`tests/ple/vllm_process_probe.py`)."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys

import pytest

from services.engine.backport.ple.activation import ADDRESS_ENV
from services.engine.vllm_engine import MULTIPROC_METHOD_ENV
from tests.ple.service_process import REPO_ROOT, ServiceProcess, service_env
from tests.ple.table_files import TableFile

pytest.importorskip("vllm")


def _probe(address: str, environment: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = service_env() | environment
    env.pop(MULTIPROC_METHOD_ENV, None)
    return subprocess.run([sys.executable, "-m", "tests.ple.vllm_process_probe", address, str(timeout_s)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_vllm_processes_of_a_ple_engine_are_spawned_and_gather(small_fp8_table: TableFile) -> None:
    with ServiceProcess(small_fp8_table.path) as service:
        probe = _probe(service.address, {ADDRESS_ENV: service.address}, timeout_s=60)
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen == {"start_method": "spawn",
                    "rows_sha256": hashlib.sha256(small_fp8_table.rows[:1024].tobytes()).hexdigest()}


def test_a_forked_vllm_process_cannot_reach_the_service(small_fp8_table: TableFile) -> None:
    """Why the rule above exists: vLLM's default, fork, from the same parent. The client's first
    call (`Describe`) runs into its deadline."""
    with ServiceProcess(small_fp8_table.path) as service:
        probe = _probe(service.address, {}, timeout_s=60)
    if probe.returncode == -signal.SIGSEGV:
        # Worse, on a loaded machine: grpc skips its fork handlers while other threads are in
        # a call, and the parent crashes.
        assert "skipping fork() handlers" in probe.stderr, probe.stderr[-3000:]
        return
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen["start_method"] == "fork" and "DEADLINE_EXCEEDED" in seen["error"], seen
