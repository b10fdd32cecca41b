"""`--cpus` pins the PLE service, all of its threads included, and refuses CPUs it lacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.ple.service_process import REPO_ROOT, ServiceProcess, service_env
from tests.ple.table_files import TableFile


def _thread_cpu_lists(pid: int) -> dict[str, str]:
    lists = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        lists[task.name] = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                                if line.startswith("Cpus_allowed_list"))
    return lists


def test_every_service_thread_runs_on_the_given_cpu(small_fp8_table: TableFile) -> None:
    cpu = max(os.sched_getaffinity(0))
    with ServiceProcess(small_fp8_table.path, extra_args=("--cpus", str(cpu))) as service:
        lists = _thread_cpu_lists(service.pid)
    assert len(lists) > 1, "grpc's threads should exist once the service serves"
    assert set(lists.values()) == {str(cpu)}, lists


def test_an_unavailable_cpu_is_refused_by_name(small_fp8_table: TableFile) -> None:
    unavailable = max(os.sched_getaffinity(0)) + 1000
    result = subprocess.run(
        [sys.executable, "-m", "services.ple_offload", "--table-path",
         str(small_fp8_table.path), "--cpus", str(unavailable), "--no-show-progress"],
        cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "cpus" in result.stderr and f"CPUs [{unavailable}] are not available" in result.stderr
