"""A closed segment's memory comes free while engines sit idle. A tmpfs file that is removed
keeps its pages as long as a process maps it, so a client unmaps a segment soon after its
service closes it, not at its next gather. A restart then fits on a tmpfs sized for one table."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from services.ple_offload.client import PleTableClient
from services.ple_offload.segment_layout import DATA_OFFSET_BYTES
from tests.ple.service_process import ServiceProcess
from tests.ple.table_files import TableFile

IDS = np.arange(64 * 16).reshape(64, 16)


def _is_mapped_here(segment: Path) -> bool:
    """Whether this process maps `segment` (listed with " (deleted)" once it is removed)."""
    return str(segment) in Path("/proc/self/maps").read_text()


def _within(timeout_s: float, condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def test_an_idle_client_unmaps_a_closed_segment(small_fp8_table: TableFile) -> None:
    table = small_fp8_table
    first = ServiceProcess(table.path).start()
    segment = Path("/dev/shm", first.shm_name)
    client = PleTableClient(first.address, reattach_timeout_s=30.0)
    second = ServiceProcess(table.path, shm_name=first.shm_name, port=first.port)
    try:
        assert client.is_local and _is_mapped_here(segment)
        assert np.array_equal(client.gather(IDS), table.rows[IDS])
        first.stop(signal.SIGTERM)
        # Without a gather: before, the closed segment stayed mapped until the next one.
        assert _within(5.0, lambda: not _is_mapped_here(segment)), (
            "an idle client kept the closed segment (and its memory) mapped")
        second.start()
        assert np.array_equal(client.gather(IDS), table.rows[IDS])
        assert client.is_local and _is_mapped_here(segment)
    finally:
        client.close()
        first.stop()
        second.stop()
    assert not _is_mapped_here(segment)


@pytest.fixture
def one_table_tmpfs(tmp_path: Path, small_fp8_table: TableFile) -> Iterator[Path]:
    """A tmpfs with room for one segment of the table and half of another."""
    segment_bytes = DATA_OFFSET_BYTES + small_fp8_table.rows.nbytes
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={segment_bytes * 3 // 2}", "ple-test", str(folder)],
        capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        # Lazily: a mapping a failed test left behind must not keep the mount.
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_restart_fits_in_a_tmpfs_sized_for_one_table(
        small_fp8_table: TableFile, one_table_tmpfs: Path, sig: signal.Signals) -> None:
    """The successor needs the closed segment's memory. Before, an attached engine held it
    until its next gather, so the new service stopped with "has N bytes free; the table
    needs M". After SIGKILL the successor retires the segment itself and then waits for
    the engines to unmap it."""
    table = small_fp8_table
    shm_dir = ("--shm-dir", str(one_table_tmpfs))
    first = ServiceProcess(table.path, extra_args=shm_dir).start()
    client = PleTableClient(first.address, reattach_timeout_s=30.0)
    second = ServiceProcess(table.path, shm_name=first.shm_name, port=first.port,
                            extra_args=shm_dir)
    try:
        assert client.is_local
        assert np.array_equal(client.gather(IDS), table.rows[IDS])
        first.stop(sig)
        second.start()
        assert np.array_equal(client.gather(IDS), table.rows[IDS])
        assert client.is_local
    finally:
        client.close()
        first.stop()
        second.stop()
    assert not list(one_table_tmpfs.iterdir())
