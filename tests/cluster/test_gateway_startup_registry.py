"""A `backport gateway` process starting against a registry whose engine goes away while the
gateway asks it for the model: a real tokenizer service and redis-server, no vLLM engine.

The engines are listening sockets that never answer (hosts that vanished mid-connection):
a real engine answers at once, and the defect needs the call still open when they leave.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.engine.registry import EngineRecord
from services.mesh.channels import wait_until_serving
from tests.cluster.processes import (RedisServer, kill_group, redis_server_binary,
                                     start_tokenizer, stop_service)
from tests.conftest import MESH_START_TIMEOUT_S, REPO_ROOT, engine_environment, free_port

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server")

RECORD_TTL_S = 0.5


@pytest.fixture
def tokenizer_address(embedded_model_path: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    process = start_tokenizer(embedded_model_path, port, tmp_path / "tokenizer.log")
    try:
        assert wait_until_serving(f"127.0.0.1:{port}", MESH_START_TIMEOUT_S)
        yield f"127.0.0.1:{port}"
    finally:
        stop_service(process)


def test_silent_fake_engines_leaving_the_registry_during_startup_keep_the_gateway_waiting(
        tokenizer_address: str, tmp_path: Path) -> None:
    """The pool closes the channels of engines that left the registry: the call asking one
    for the model ends as cancelled, and the next engine of that round has a closed channel.
    The gateway must go on waiting for an engine, not fail its startup and exit."""
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()
    listeners = [socket.socket() for _ in range(2)]
    for listener in listeners:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
    records = [EngineRecord(f"127.0.0.1:{listener.getsockname()[1]}", "m", 64, RECORD_TTL_S)
               for listener in listeners]
    registry = redis.Redis(port=server.port, socket_timeout=1.0)
    connections: list[socket.socket] = []
    port = free_port()
    with (tmp_path / "gateway.log").open("wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "gateway", "--port", str(port),
             "--tokenizer", tokenizer_address, "--redis-url", server.url,
             "--registry-poll-s", "0.05"],
            cwd=REPO_ROOT, env=engine_environment(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        # Heartbeats, as the engines', until the gateway connects to ask for the model.
        deadline = time.monotonic() + 120
        while not connections:
            assert time.monotonic() < deadline, "the gateway never called an engine"
            assert gateway.poll() is None, (tmp_path / "gateway.log").read_text()
            for record in records:
                registry.set(record.key, record.encode(), px=int(RECORD_TTL_S * 1000))
            for listener in listeners:
                try:
                    connections.append(listener.accept()[0])
                except BlockingIOError:
                    pass
            time.sleep(0.1)
        # The records expire; the gateway drops both engines a TTL later, closing their channels.
        time.sleep(4 * RECORD_TTL_S + 2.0)
        assert gateway.poll() is None, (
            "the gateway exited when engines left during its startup:\n"
            + (tmp_path / "gateway.log").read_text()[-3000:])
    finally:
        kill_group(gateway)
        gateway.wait()
        for open_socket in [*connections, *listeners]:
            open_socket.close()
        server.stop()
