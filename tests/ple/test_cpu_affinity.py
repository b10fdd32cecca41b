"""`--cpus` pins the PLE service, all of its threads included, and refuses CPUs it lacks."""

from __future__ import annotations

import os
import subprocess

from tests.ple.service_process import (
    REPO_ROOT,
    ServiceProcess,
    service_command,
    service_env,
    thread_status,
)
from tests.ple.table_files import TableFile


def test_every_service_thread_runs_on_the_given_cpu(small_fp8_table: TableFile) -> None:
    cpu = max(os.sched_getaffinity(0))
    with ServiceProcess(small_fp8_table.path, extra_args=("--cpus", str(cpu))) as service:
        lists = thread_status(service.pid, "Cpus_allowed_list")
    assert len(lists) > 1, "grpc's threads should exist once the service serves"
    assert {cpus for _, cpus in lists} == {str(cpu)}, lists


def test_an_unavailable_cpu_is_refused_by_name(small_fp8_table: TableFile) -> None:
    unavailable = max(os.sched_getaffinity(0)) + 1000
    result = subprocess.run(
        service_command(small_fp8_table.path, "--cpus", str(unavailable)), cwd=REPO_ROOT,
        env=service_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "cpus" in result.stderr and f"CPUs [{unavailable}] are not available" in result.stderr
