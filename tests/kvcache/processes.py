"""Real processes for the KV-cache tests and benchmark: the KV service and engine probes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ONE_ENGINE_THREAD, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "engine_probe.py"
SERVICE_START_TIMEOUT_S = 300.0
PROBE_TIMEOUT_S = 900.0


def lmcache_python() -> str | None:
    """An interpreter whose environment has lmcache and vLLM, or None.

    `BACKPORT_KVCACHE_PYTHON` names one explicitly (LMCache's pins can need their own venv);
    otherwise this interpreter, when it can import both.
    """
    explicit = os.environ.get("BACKPORT_KVCACHE_PYTHON")
    candidates = [explicit] if explicit else [sys.executable]
    for python in candidates:
        probe = subprocess.run([python, "-c", "import lmcache, vllm"], capture_output=True)
        if probe.returncode == 0:
            return python
    return None


def process_environment() -> dict[str, str]:
    env = ONE_ENGINE_THREAD | dict(os.environ)
    env["LMCACHE_DISABLE_BANNER"] = "1"
    env["LMCACHE_TRACK_USAGE"] = "false"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class KvService:
    process: subprocess.Popen[bytes]
    port: int
    http_port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=10) as r:
            return json.load(r)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


def start_kv_service(python: str, log_dir: Path, *args: str) -> KvService:
    """`python -m services.kvcache` on free ports, returned once LMCache answers /healthcheck."""
    port, http_port = free_port(), free_port()
    log_path = log_dir / f"kvcache-{port}.log"
    command = [python, "-m", "services.kvcache", "--port", str(port), "--http-port", str(http_port),
               "--l1-size-gib", "1", *args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=process_environment(), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    service = KvService(process, port, http_port, log_path)
    deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"KV service exited early:\n{service.log_tail()}")
        if b"KV cache service ready" in log_path.read_bytes():
            return service
        time.sleep(1.0)
    service.stop()
    raise TimeoutError(f"KV service not ready in {SERVICE_START_TIMEOUT_S} s:\n{service.log_tail()}")


def run_engine_probe(python: str, model: Path, service: KvService | None, transfer_mode: str,
                     prompts: list[str], log_dir: Path, *extra: str) -> list[dict]:
    """Runs one engine process to completion; returns its per-request JSON records."""
    command = [python, str(PROBE), "--model", str(model), "--transfer-mode", transfer_mode,
               *extra]
    if service is not None:
        command += ["--kv-service", service.address]
    for prompt in prompts:
        command += ["--prompt", prompt]
    run_id = time.monotonic_ns()
    log_path = log_dir / f"engine-{run_id}.log"
    records_path = log_dir / f"engine-{run_id}.jsonl"
    command += ["--records-file", str(records_path)]
    with log_path.open("wb") as log:
        finished = subprocess.run(command, cwd=REPO_ROOT, env=process_environment(), stdout=log,
                                  stderr=subprocess.STDOUT, timeout=PROBE_TIMEOUT_S)
    records = ([json.loads(line) for line in records_path.read_text().splitlines()]
               if records_path.exists() else [])
    requests = [r for r in records if r["event"] == "request"]
    if finished.returncode != 0 or len(requests) != len(prompts):
        raise RuntimeError(f"engine probe failed (status {finished.returncode}):\n"
                           f"{log_path.read_text(errors='replace')[-3000:]}")
    return requests
