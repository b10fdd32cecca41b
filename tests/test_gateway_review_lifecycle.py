"""A `backport gateway` process starting and stopping: while the mesh it needs is not up yet
it waits for the tokenizer service and the engines, and a signal still stops it at once
meanwhile; while it drains, a client's keep-alive connection does not keep bringing it
requests. Real gateway processes over the shared mesh's services (or none where one must be
missing)."""

from __future__ import annotations

import itertools
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster.processes import kill_group, start_tokenizer, stop_service
from tests.conftest import (MESH_START_TIMEOUT_S, REPO_ROOT, RunningMesh, engine_environment,
                            free_port, wait_for_http_ok)

# What a stop may take: the gateway has nothing open to drain.
STOP_DEADLINE_S = 10.0


def start_gateway(log_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "gateway", "--port", str(port), *args],
            cwd=REPO_ROOT, env=engine_environment() | {"BACKPORT_LOG_LEVEL": "INFO"}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    return process, port


@pytest.fixture
def gateways() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            kill_group(process)
            process.wait()


def wait_for_log(log_path: Path, text: str, process: subprocess.Popen[bytes],
                 timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_text(errors="replace"):
        assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, f"no {text!r} in the log within {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_gateway_still_waiting_for_its_engines(
        mesh: RunningMesh, tmp_path: Path, gateways: list[subprocess.Popen[bytes]],
        sig: signal.Signals) -> None:
    """Compose starts the gateway as the engines start loading, minutes before they answer; a
    `docker compose stop` (SIGTERM) or a Ctrl-C meanwhile must stop it, not wait out the
    gateway's ten-minute wait for an engine."""
    log_path = tmp_path / "gateway.log"
    process, _ = start_gateway(log_path, "--tokenizer", mesh.tokenizer_address,
                               "--engine", f"127.0.0.1:{free_port()}")  # no engine there yet
    gateways.append(process)
    wait_for_log(log_path, "waiting for engine", process, 120)
    process.send_signal(sig)
    try:
        returncode = process.wait(timeout=STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the gateway still runs {STOP_DEADLINE_S} s after {sig.name}:\n"
                    + log_path.read_text(errors="replace")[-2000:])
    assert returncode == 0, log_path.read_text(errors="replace")[-4000:]
    assert "Traceback" not in log_path.read_text(errors="replace")


def test_a_gateway_started_before_its_tokenizer_service_waits_for_it(
        mesh: RunningMesh, embedded_model_path: Path, tmp_path: Path,
        gateways: list[subprocess.Popen[bytes]]) -> None:
    """Compose starts the tokenizer service and the gateway together; the service takes
    seconds to load before it listens. The gateway must wait for it, as it waits for engines,
    not exit at its first refused connection."""
    tokenizer_port = free_port()
    log_path = tmp_path / "gateway.log"
    process, port = start_gateway(log_path, "--tokenizer", f"127.0.0.1:{tokenizer_port}",
                                  "--engine", mesh.engine_address)
    gateways.append(process)
    time.sleep(3)
    assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
    tokenizer = start_tokenizer(embedded_model_path, tokenizer_port, tmp_path / "tokenizer.log")
    try:
        wait_for_http_ok(f"http://127.0.0.1:{port}/health", MESH_START_TIMEOUT_S, process)
    finally:
        stop_service(tokenizer)


def exchange(connection: socket.socket, path: str) -> int:
    """One GET on an open HTTP/1.1 connection, read to the end of its body; its status."""
    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    received = b""
    while b"\r\n\r\n" not in received:
        received += connection.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
    assert length is not None, head
    while len(body) < int(length.group(1)):
        body += connection.recv(65536)
    return int(head.split()[1])


def test_a_draining_gateway_closes_the_keep_alive_connection_it_refuses_a_request_on(
        mesh: RunningMesh, tmp_path: Path, gateways: list[subprocess.Popen[bytes]]) -> None:
    """Clients pool their connections. Left open, a pooled connection brings every retry back
    to the draining gateway, to be refused again for as long as its open streams take (up to
    the drain timeout); closed, the client's retry connects anew, through the load balancer,
    to a replica that serves."""
    process, port = start_gateway(tmp_path / "gateway.log", "--tokenizer", mesh.tokenizer_address,
                                  "--engine", mesh.engine_address, "--drain-timeout-s", "120")
    gateways.append(process)
    origin = f"http://127.0.0.1:{port}"
    wait_for_http_ok(f"{origin}/health", 120, process)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as pooled, \
            httpx.Client(timeout=120) as http, \
            http.stream("POST", f"{origin}/v1/completions", json={
                "model": "SmolLM2-135M-Instruct-bf16", "prompt": "Once upon a time",
                "max_tokens": 1500, "ignore_eos": True, "stream": True}) as open_stream:
        assert exchange(pooled, "/v1/models") == 200
        # The drain waits for this stream. Kept: a dropped line iterator closes the stream.
        stream_lines = open_stream.iter_lines()
        next(stream_lines)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{origin}/health").status_code != 503:
            assert time.monotonic() < deadline, "the gateway never began to drain"
            time.sleep(0.1)
        assert exchange(pooled, "/v1/models") == 503
        # Well within uvicorn's keep-alive timeout (5 s), which closes an idle connection anyway.
        pooled.settimeout(1)
        try:
            assert pooled.recv(1) == b"", "the refused connection carried more bytes"
        except TimeoutError:
            pytest.fail("the draining gateway keeps the connection it refused a request on open")
        assert any(line.startswith("data: ") for line in itertools.islice(stream_lines, 2)), (
            "the open stream was cut")
