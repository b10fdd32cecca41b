"""How the KV service stops LMCache's server and what it left behind.

LMCache's server takes seconds to start; a shell script stands in for it (hence the names),
in its own process group as the real one is started."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from services.kvcache.runner import LmcacheServer
from services.kvcache.settings import KvCacheSettings


def start_stand_in(server: LmcacheServer, script: str, pid_file: Path) -> int:
    """Starts `script` as the server; returns the pid of the helper it leaves in its group."""
    server.process = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the stand-in did not start its helper"
        time.sleep(0.02)
    return int(pid_file.read_text())


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stand_in_server_that_died_leaves_no_helper_behind(tmp_path: Path) -> None:
    server = LmcacheServer(KvCacheSettings(stop_timeout_s=5))
    pid_file = tmp_path / "helper.pid"
    helper = start_stand_in(server, f"sleep 300 & echo $! > {pid_file}; exit 3", pid_file)
    deadline = time.monotonic() + 10
    while server.returncode is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert server.returncode == 3
    # Seen to have exited, but not reaped: its pid still names its group for the kill.
    assert server.process is not None and server.process.returncode is None
    server.stop()
    assert server.process.returncode == 3
    time.sleep(0.1)
    assert not is_alive(helper)


def test_stand_in_server_that_ignores_sigterm_is_killed_with_its_group(tmp_path: Path) -> None:
    server = LmcacheServer(KvCacheSettings(stop_timeout_s=1))
    pid_file = tmp_path / "helper.pid"
    helper = start_stand_in(
        server, f"trap '' TERM; sleep 300 & echo $! > {pid_file}; while :; do sleep 0.1; done",
        pid_file)
    started = time.monotonic()
    server.stop()
    assert 1 <= time.monotonic() - started < 5
    assert server.process is not None and server.process.returncode == -9
    time.sleep(0.1)
    assert not is_alive(helper)
