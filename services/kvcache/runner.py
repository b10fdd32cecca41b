"""`backport kvcache`: runs stock `lmcache server` until SIGTERM, then frees what it held."""

from __future__ import annotations

import http.client
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

from services.kvcache import RUNNER_LIFELINE_FD_ENV
from services.kvcache.server_command import lmcache_server_argv
from services.kvcache.settings import KvCacheSettings
from services.kvcache.shm_segments import reclaim_exited_engine_segments
from services.mesh.ports import is_port_free

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5
STOP_POLL_S = 0.05
REPO_ROOT = Path(__file__).resolve().parents[2]


class LmcacheServerError(RuntimeError):
    """LMCache's server could not start, or died while serving."""


def lmcache_environment() -> dict[str, str]:
    env = dict(os.environ)
    # LMCache and vLLM report usage to their vendors unless told not to.
    env["LMCACHE_TRACK_USAGE"] = "false"
    env["DO_NOT_TRACK"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # The server runs as `python -m services.kvcache.lmcache_server`, maybe by another interpreter.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def is_ready(http_port: int, timeout_s: float = 2.0) -> bool:
    """LMCache's `/healthcheck` answers 200 once its cache engine is up (503 before)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthcheck",
                                    timeout=timeout_s) as reply:
            return reply.status == 200
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError):
        # HTTPException: something other than LMCache answers on the port, or answers half.
        return False


def finds_lmcache(python: str) -> bool:
    """Whether `python` finds the lmcache package (found, not imported: importing takes seconds).
    It must say so: any program that exits 0 (`/bin/true`) would pass a check of its status."""
    probe = subprocess.run(
        [python, "-c", "import importlib.util; print(importlib.util.find_spec('lmcache') is not None)"],
        env=lmcache_environment(), capture_output=True)
    return probe.returncode == 0 and probe.stdout.strip() == b"True"


class LmcacheServer:
    """One `lmcache server` child in its own process group."""

    def __init__(self, settings: KvCacheSettings) -> None:
        self.settings = settings
        self.process: subprocess.Popen[bytes] | None = None
        # The write end of the server's lifeline: it closes when this process ends, however it
        # ends, and the server stops (`services.mesh.lifeline`).
        self._lifeline: int | None = None

    def start(self) -> None:
        # A server already on these ports would answer our health checks in its place.
        for port in (self.settings.port, self.settings.http_port):
            if not is_port_free(self.settings.host, port):
                raise LmcacheServerError(f"port {port} on {self.settings.host} is already in use")
        argv = lmcache_server_argv(self.settings)
        # Checked first: without it the server dies on its import, a traceback that does not say
        # what to install.
        if not finds_lmcache(argv[0]):
            raise LmcacheServerError(
                f"lmcache is not installed for {argv[0]}: run `make kvcache-deps`, or give "
                "--lmcache-python a Python whose environment has it (docs/kvcache.md)")
        logger.info("starting %s", " ".join(argv))
        lifeline_read, self._lifeline = os.pipe()
        try:
            self.process = subprocess.Popen(
                argv, env=lmcache_environment() | {RUNNER_LIFELINE_FD_ENV: str(lifeline_read)},
                start_new_session=True, pass_fds=(lifeline_read,))
        finally:
            os.close(lifeline_read)

    @property
    def returncode(self) -> int | None:
        """The server's exit status (negative: the signal that ended it), None while it runs.

        The server is left unreaped until `stop`: while it is a zombie its pid names its process
        group and no other process can take it, so `stop` can kill what it left behind."""
        if self.process is None:
            return None
        if self.process.returncode is not None:
            return self.process.returncode
        ended = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if ended is None:
            return None
        return ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status

    def wait_ready(self, stop: threading.Event) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while not stop.is_set():
            if self.returncode is not None:
                raise LmcacheServerError(f"lmcache server exited with status {self.returncode} "
                                         "before it was ready")
            if is_ready(self.settings.http_port):
                return
            if time.monotonic() > deadline:
                raise LmcacheServerError(
                    f"lmcache server not ready after {self.settings.startup_timeout_s:.0f} s")
            stop.wait(HEALTH_POLL_S)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL for the whole group once `stop_timeout_s` has passed."""
        if self.process is None:
            return
        if self.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.settings.stop_timeout_s
            while self.returncode is None and time.monotonic() < deadline:
                time.sleep(STOP_POLL_S)
            if self.returncode is None:
                logger.warning("lmcache server did not stop in %.0f s; killing it",
                               self.settings.stop_timeout_s)
        if self.process.returncode is None:
            # Unreaped until the wait below, so the pid still names the server's group only.
            # Killing the group also ends any helper LMCache started that outlived the server.
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None


def run(settings: KvCacheSettings) -> int:
    """Serves until SIGTERM/SIGINT (status 0) or until LMCache dies (status 1)."""
    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        logger.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    server = LmcacheServer(settings)
    try:
        reclaim_exited_engine_segments()
        server.start()
        server.wait_ready(stop)
        if not stop.is_set():
            logger.info("KV cache service ready at %s (HTTP %d, transfer %s, chunk %d tokens)",
                        settings.address, settings.http_port, settings.transfer_mode.value,
                        settings.chunk_size_tokens)
        while not stop.wait(settings.shm_reclaim_interval_s):
            if server.returncode is not None:
                raise LmcacheServerError(f"lmcache server exited with status {server.returncode}")
            reclaim_exited_engine_segments()
        return 0
    except LmcacheServerError as error:
        logger.error("%s", error)
        return 1
    finally:
        server.stop()
        # The server's own pool and any engine segment it alone still named are gone with it.
        reclaim_exited_engine_segments()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
