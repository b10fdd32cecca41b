"""A service whose port is taken refuses to start instead of sharing the port."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.mesh.channels import wait_until_serving
from services.mesh.errors import ServiceStartError
from services.mesh.grpc_server import GrpcServer
from services.mesh.service_names import ENGINE_GRPC, TOKENIZER_GRPC
from tests.conftest import REPO_ROOT, engine_environment, free_port, wait_for_grpc_serving


def test_second_server_on_a_taken_port_fails_to_start() -> None:
    address = f"127.0.0.1:{free_port()}"

    async def start_two() -> None:
        first = GrpcServer("first", address)
        await first.start()
        try:
            second = GrpcServer("second", address)
            with pytest.raises(ServiceStartError, match=f"second cannot listen on {address}"):
                await second.start()
        finally:
            await first.server.stop(None)

    asyncio.run(start_two())


def test_a_port_held_by_another_service_is_not_taken_for_serving() -> None:
    """`backport up` once gave a second engine the tokenizer's port, and the tokenizer's health
    answered for it. The launcher now asks by service name."""
    address = f"127.0.0.1:{free_port()}"

    async def check() -> tuple[bool, bool]:
        tokenizer = GrpcServer(TOKENIZER_GRPC, address)
        await tokenizer.start()
        await tokenizer.set_serving(True)
        try:
            return (await asyncio.to_thread(wait_until_serving, address, 1.0, TOKENIZER_GRPC),
                    await asyncio.to_thread(wait_until_serving, address, 1.0, ENGINE_GRPC))
        finally:
            await tokenizer.stop_now()

    assert asyncio.run(check()) == (True, False)


def test_tokenizer_on_a_taken_port_exits_naming_it(embedded_model_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "services.cli", "tokenizer", "--model", str(embedded_model_path),
               "--port", str(port)]
    first = subprocess.Popen(command, cwd=REPO_ROOT, env=engine_environment(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", 120, first)
        second = subprocess.run(command, cwd=REPO_ROOT, env=engine_environment(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second.stderr[-2000:]
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.terminate()
        first.wait(timeout=30)


def test_gateway_on_a_taken_port_exits_naming_it_without_waiting_for_the_mesh() -> None:
    """It waited for its engine first (logging UNAVAILABLE twice a second, for good with none
    there), and only then found the port taken."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        command = [sys.executable, "-m", "services.cli", "gateway", "--port", str(port),
                   "--engine", f"127.0.0.1:{free_port()}", "--tokenizer", f"127.0.0.1:{free_port()}"]
        finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=60)
    assert finished.returncode == 1, finished.stderr[-2000:]
    assert f"gateway cannot listen on 127.0.0.1:{port}: the port is already in use" in finished.stderr
    assert "Traceback" not in finished.stderr and "waiting for" not in finished.stderr
