"""`backport kvcache` killed outright (SIGKILL, the OOM killer, `backport up`'s kill once its
stop timed out): the LMCache server it started must not outlive it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from services.mesh.ports import is_port_free
from tests.cluster.processes import has_exited
from tests.kvcache.processes import lmcache_python, start_kv_service

# LMCache stops in a few seconds on SIGTERM (the runner's own stop gives it 20).
LMCACHE_STOP_TIMEOUT_S = 30.0


def test_the_lmcache_server_stops_when_the_kv_service_is_killed_outright(tmp_path: Path) -> None:
    """It runs in a session of its own (a Ctrl-C for the runner must not reach it first), so
    nothing ended it: it went on holding its ports and its L1 memory, and the next start on
    those ports was refused."""
    python = lmcache_python()
    if python is None:
        pytest.skip("lmcache (make kvcache-deps) and vllm are not importable")
    service = start_kv_service(python, tmp_path)
    [lmcache] = psutil.Process(service.process.pid).children()
    try:
        os.kill(service.process.pid, signal.SIGKILL)
        service.process.wait()
        deadline = time.monotonic() + LMCACHE_STOP_TIMEOUT_S
        while not has_exited(lmcache) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert has_exited(lmcache), f"LMCache ({lmcache.pid}) outlived the KV service"
        assert is_port_free("127.0.0.1", service.port) and is_port_free("127.0.0.1", service.http_port)
    finally:
        if not has_exited(lmcache):
            os.killpg(lmcache.pid, signal.SIGKILL)
