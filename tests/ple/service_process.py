"""Starts the PLE service as a real child process for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from services.mesh.channels import wait_until_serving
from services.ple_offload.settings import LISTEN_ADDRESS_ENV
from tests.conftest import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def unique_shm_name() -> str:
    return f"backport-ple-test-{uuid.uuid4().hex[:12]}"


def thread_status(pid: int, field: str) -> list[tuple[str, str]]:
    """(thread name, its `field` in /proc status) for each thread of `pid` still running."""
    values = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:
            continue  # the thread ended
        fields = dict(line.split(":", 1) for line in status.splitlines())
        values.append((fields["Name"].strip(), fields[field].strip()))
    return values


def service_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "protos")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    return env


# The two ways to start the service: `python -m services.ple_offload` and `backport ple`.
MODULE_ENTRY = ("-m", "services.ple_offload")
CLI_ENTRY = ("-m", "services.cli", "ple")


def service_command(table_path: Path, *args: str,
                    entry: tuple[str, ...] = MODULE_ENTRY) -> list[str]:
    """The service's command line for `table_path`, without a progress bar, then `args`."""
    return [sys.executable, *entry, "--table-path", str(table_path), "--no-show-progress", *args]


class ServiceProcess:
    """One PLE service child (`python -m services.ple_offload` unless `entry` says
    otherwise), told its address by `--address` or, with `listen_by_env`, by
    BACKPORT_PLE_LISTEN_ADDRESS; `stop()` sends SIGTERM like an operator."""

    def __init__(self, table_path: Path, *, shm_name: str | None = None, port: int | None = None,
                 extra_args: tuple[str, ...] = (), entry: tuple[str, ...] = MODULE_ENTRY,
                 extra_env: dict[str, str] | None = None, listen_by_env: bool = False) -> None:
        self.table_path = table_path
        self.shm_name = shm_name or unique_shm_name()
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.extra_args = extra_args
        self.entry = entry
        self.extra_env = extra_env or {}
        self.listen_by_env = listen_by_env
        self.process: subprocess.Popen[str] | None = None
        self._output: str | None = None  # what it printed, once stopped

    def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        self._output = None
        address_args = () if self.listen_by_env else ("--address", self.address)
        address_env = {LISTEN_ADDRESS_ENV: self.address} if self.listen_by_env else {}
        self.process = subprocess.Popen(
            service_command(self.table_path, *address_args, "--shm-name", self.shm_name,
                            "--grace-s", "1", *self.extra_args, entry=self.entry),
            cwd=REPO_ROOT, env=service_env() | self.extra_env | address_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        # A second at a time, so a service that exits is reported at once, not at the deadline.
        while self.process.poll() is None and time.monotonic() < deadline:
            if wait_until_serving(self.address, 1.0):
                return self
        output = self.stop()
        raise RuntimeError(f"PLE service did not start:\n{output}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> str:
        """Signals the service, waits for it and returns everything it printed. Stopping
        it again returns the same."""
        if self.process is None:
            return ""
        if self._output is None:
            if self.process.poll() is None:
                self.process.send_signal(sig)
            self._output, _ = self.process.communicate(timeout=timeout_s)
        return self._output

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
