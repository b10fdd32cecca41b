"""Real processes for the cluster tests: a Redis server, standalone engines, HTTP load."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.conftest import REPO_ROOT, RunningMesh, engine_environment, free_port, wait_for_http_ok

GATEWAY_START_TIMEOUT_S = 120.0


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


@dataclass
class RedisServer:
    """A throwaway redis-server without persistence: a restart comes back empty."""

    port: int
    log_path: Path
    password: str | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = redis_server_binary()
        assert binary is not None
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", *(["--requirepass", self.password] if self.password else [])],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while self.ping() is False:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, password=self.password, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def keys(self, pattern: str) -> list[str]:
        import redis

        client = redis.Redis(port=self.port, password=self.password, socket_timeout=1.0,
                             decode_responses=True)
        return sorted(client.keys(pattern))

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def start_engine(model: Path, port: int, log_path: Path, *args: str,
                 environment: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A standalone engine in its own process group (vLLM's engine core included), in
    `environment` (the tests' engine environment by default)."""
    command = [sys.executable, "-m", "services.cli", "engine", "--model", str(model),
               "--port", str(port), "--enforce-eager", *args]
    with log_path.open("wb") as log:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=environment or engine_environment(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def start_tokenizer(model: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """A standalone tokenizer service in its own process group."""
    command = [sys.executable, "-m", "services.cli", "tokenizer", "--model", str(model),
               "--port", str(port)]
    with log_path.open("wb") as log:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=engine_environment(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def gateway_over(mesh: RunningMesh, log_dir: Path, *args: str,
                 env: dict[str, str] | None = None) -> Iterator[str]:
    """A gateway process with `args` over `mesh`'s engine and tokenizer service; yields its
    base URL (`.../v1`) once it answers /health."""
    port = free_port()
    log_path = log_dir / f"gateway-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "gateway", "--port", str(port),
             "--engine", mesh.engine_address, "--tokenizer", mesh.tokenizer_address, *args],
            cwd=REPO_ROOT, env=engine_environment() | (env or {}), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_http_ok(f"http://127.0.0.1:{port}/health", GATEWAY_START_TIMEOUT_S, process)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        kill_group(process)
        process.wait()


def kill_group(process: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def stop_service(process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM, then SIGKILL of its group if it is still there after `timeout_s`.

    A fixture's engine is stopped this way: killed outright, vLLM leaves its shared-memory
    queues and semaphores (`/dev/shm/psm_*`, `sem.mp-*`) and its socket files behind.
    """
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_group(process)
        process.wait()


def shared_memory_mapped_by(process: psutil.Process) -> list[Path]:
    """The vLLM message queues in `/dev/shm` that `process` maps. An engine core killed outright
    leaves the 160 MB queue it created behind: nothing else unlinks it."""
    return sorted({Path(region.path) for region in process.memory_maps()
                   if region.path.startswith("/dev/shm/psm_")})


def child_pid(parent: int, *words: str) -> int:
    """The pid of `parent`'s child whose command line holds `words` in that order."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and any(args[i:i + len(words)] == list(words) for i in range(len(args))):
            return int(entry.name)
    raise LookupError(f"no child of {parent} with {words}")


def engine_num_running(address: str) -> int:
    """The requests the engine at `address` is running, from its own `GetLoads`."""
    import asyncio

    from services.engine.client import EngineClient

    async def loads() -> int:
        engine = EngineClient(address)
        try:
            return (await engine.loads()).num_running
        finally:
            await engine.close()

    return asyncio.run(loads())


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def scrape(url: str) -> dict[str, float]:
    """Prometheus text format to {sample name with labels: value}."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for sample, value in samples.items():
        sample_name, _, rest = sample.partition("{")
        if sample_name == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


@dataclass
class StreamRecord:
    """What one streamed completion saw: its engine, events and when it ended."""

    engine: str | None = None
    num_text_events: int = 0
    finish_reason: str | None = None
    error: dict | None = None
    saw_done: bool = False
    status: int | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    exception: str | None = None
    started: threading.Event = field(default_factory=threading.Event)


def stream_completion(base_url: str, api_key: str, prompt: list[int], max_tokens: int,
                      record: StreamRecord, timeout_s: float = 120) -> None:
    import json

    body = {"model": "SmolLM2-135M-Instruct-bf16", "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        with httpx.Client(timeout=timeout_s) as http:
            with http.stream("POST", f"{base_url}/completions", json=body,
                             headers={"Authorization": f"Bearer {api_key}"}) as reply:
                record.status = reply.status_code
                record.engine = reply.headers.get("x-backport-engine")
                for line in reply.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        record.saw_done = True
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        record.error = event["error"]
                        continue
                    choice = event["choices"][0]
                    if choice.get("text"):
                        record.num_text_events += 1
                        if record.first_token_at is None:
                            record.first_token_at = time.monotonic()
                            record.started.set()
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
    except Exception as error:  # the test asserts on it: a hang or a broken stream
        record.exception = repr(error)
    finally:
        record.ended_at = time.monotonic()
        record.started.set()


def in_threads(target: Callable[..., None], argument_lists: list[tuple]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=args, daemon=True) for args in argument_lists]
    for thread in threads:
        thread.start()
    return threads


def wait_for_exits(processes: list[psutil.Process], timeout_s: float) -> dict[int, float]:
    """{pid: when it was first seen exited} for the processes that exit within `timeout_s`."""
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(exited_at) < len(processes) and time.monotonic() < deadline:
        for process in processes:
            if process.pid not in exited_at and has_exited(process):
                exited_at[process.pid] = time.monotonic()
        time.sleep(0.1)
    return exited_at


def has_exited(process: psutil.Process) -> bool:
    """Orphans are reaped by whoever adopts them, which in a container may be no one."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def commands_of(processes: Iterable[psutil.Process]) -> list[str]:
    commands = []
    for process in processes:
        try:
            commands.append(f"{process.pid} {' '.join(process.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            pass
    return commands


def engine_ipc_dirs(processes: Iterable[psutil.Process]) -> set[Path]:
    """The folders of the vLLM socket files these processes have open: an engine service's
    own folder (`backport-engine-ipc-*`, services/engine/vllm_engine.py) for each engine. Read
    from the sockets, not the environment: a forked engine core's /proc environ is the one its
    service was started with."""
    folders = set()
    for process in processes:
        try:
            sockets = process.net_connections(kind="unix")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for path in (Path(s.laddr) for s in sockets if s.laddr):
            if path.parent.name.startswith("backport-engine-ipc-"):
                folders.add(path.parent)
    return folders
