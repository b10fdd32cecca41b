"""Two engine-side clients and the service hold one copy of a multi-GB table between them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ple.service_process import REPO_ROOT, ServiceProcess, service_env
from tests.ple.table_files import write_sparse_table

ROW_BYTES = 320
NUM_ROWS = int(float(os.environ.get("BACKPORT_PLE_TEST_MEMORY_GIB", "1.25")) * 2**30) // ROW_BYTES


def smaps_rollup_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value)
    return fields


def test_service_and_two_clients_hold_one_copy(tmp_path: Path) -> None:
    table_path = tmp_path / "big.safetensors"
    write_sparse_table(table_path, NUM_ROWS, ROW_BYTES)
    table_kib = NUM_ROWS * ROW_BYTES // 1024
    clients: list[subprocess.Popen[str]] = []
    with ServiceProcess(table_path) as service:
        try:
            for _ in range(2):
                client = subprocess.Popen(
                    [sys.executable, "-m", "tests.ple.memory_client", service.address],
                    cwd=REPO_ROOT, env=service_env(), stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True)
                clients.append(client)
            for client in clients:
                assert client.stdout is not None
                assert client.stdout.readline().startswith("ready")
            pids = {"service": service.pid} | {f"client {i}": c.pid for i, c in enumerate(clients)}
            usage = {role: smaps_rollup_kib(pid) for role, pid in pids.items()}
        finally:
            for client in clients:
                client.communicate(input="", timeout=30)
    print(f"\ntable {table_kib / 2**20:.2f} GiB")
    for role, fields in usage.items():
        print(f"{role:>9}: Rss {fields['Rss'] / 2**20:6.2f} GiB  Pss {fields['Pss'] / 2**20:6.2f} GiB"
              f"  Pss_Shmem {fields.get('Pss_Shmem', 0) / 2**20:6.2f} GiB")
    total_pss = sum(f["Pss"] for f in usage.values())
    print(f"   total Pss {total_pss / 2**20:.2f} GiB")
    for role, fields in usage.items():
        assert fields["Rss"] >= 0.99 * table_kib, f"{role} did not map the whole table"
    # One copy of the table plus three Python processes' own memory, not three copies.
    assert total_pss < table_kib + 3 * 200 * 1024
    assert sum(f.get("Pss_Shmem", 0) for f in usage.values()) == pytest.approx(table_kib, rel=0.02)
