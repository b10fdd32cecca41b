"""The served rows are the file's rows, over shared memory and gRPC, and survive restarts."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from services.ple_offload.client import PleTableClient
from services.ple_offload.errors import RowIdError, TableClosedError, TableUnavailableError
from services.ple_offload.table_reader import SharedTableReader
from tests.ple.service_process import ServiceProcess
from tests.ple.table_files import TableFile

HEADS = 16
BATCH_TOKENS = (1, 64, 2048)  # 2048 x 16 rows takes the multi-threaded gather
NUM_CALLERS = 4


@pytest.fixture(scope="module", params=["fp8", "bf16"])
def served_table(request: pytest.FixtureRequest) -> Iterator[tuple[TableFile, ServiceProcess]]:
    table: TableFile = request.getfixturevalue(f"{request.param}_table")
    with ServiceProcess(table.path) as service:
        yield table, service


def _caller(client: PleTableClient, rows: np.ndarray, seed: int) -> int:
    rng = np.random.default_rng(seed)
    checked = 0
    for step in range(30):
        ids = rng.integers(0, rows.shape[0], (BATCH_TOKENS[step % 3], HEADS))
        got = client.gather(ids)
        if not np.array_equal(got, rows[ids]):
            raise AssertionError(f"caller {seed} step {step}: rows differ from the file")
        checked += ids.size
    return checked


def test_rows_equal_the_file_under_concurrent_callers(
        served_table: tuple[TableFile, ServiceProcess]) -> None:
    table, service = served_table
    local = PleTableClient(service.address, gather_threads=2)
    remote = PleTableClient(service.address, allow_shared_memory=False)
    try:
        assert local.is_local and not remote.is_local
        assert local.row_bytes == table.rows.shape[1] and local.num_rows == table.rows.shape[0]
        if table.scale is not None:
            assert local.info.scale == pytest.approx(table.scale)
        edge_ids = np.array([[0, table.rows.shape[0] - 1]])
        for client in (local, remote):
            assert np.array_equal(client.gather(edge_ids), table.rows[edge_ids])
        with ThreadPoolExecutor(2 * NUM_CALLERS) as pool:
            futures = [pool.submit(_caller, client, table.rows, seed)
                       for seed in range(NUM_CALLERS) for client in (local, remote)]
            assert sum(f.result() for f in futures) == 2 * NUM_CALLERS * 10 * HEADS * sum(BATCH_TOKENS)
    finally:
        local.close()
        remote.close()


def test_out_of_range_ids_are_refused(served_table: tuple[TableFile, ServiceProcess]) -> None:
    table, service = served_table
    for allow_shared_memory in (True, False):
        client = PleTableClient(service.address, allow_shared_memory=allow_shared_memory)
        try:
            for bad in (-1, table.rows.shape[0]):
                with pytest.raises(RowIdError, match="out of range"):
                    client.gather(np.array([[0, bad]]))
        finally:
            client.close()


def _segment_exists(service: ServiceProcess) -> bool:
    return Path("/dev/shm", service.shm_name).exists()


def test_restart_gives_attached_clients_a_clear_error_then_they_reattach(
        small_fp8_table: TableFile) -> None:
    table = small_fp8_table
    ids = np.random.default_rng(7).integers(0, table.rows.shape[0], (64, HEADS))
    first = ServiceProcess(table.path).start()
    reader = SharedTableReader(first.shm_name)
    local = PleTableClient(first.address, reattach_timeout_s=0.5)
    remote = PleTableClient(first.address, allow_shared_memory=False, reattach_timeout_s=0.5)
    second = ServiceProcess(table.path, shm_name=first.shm_name, port=first.port)
    try:
        assert np.array_equal(local.gather(ids), table.rows[ids])
        log = first.stop(signal.SIGTERM)
        assert first.process is not None and first.process.returncode == 0, log
        assert not _segment_exists(first), "SIGTERM must free the shared memory"

        with pytest.raises(TableClosedError, match="stopped or restarted; reattach"):
            reader.gather(ids)
        for client in (local, remote):
            with pytest.raises(TableUnavailableError, match="did not come back within 0.5 s"):
                client.gather(ids)

        second.start()
        for client in (local, remote):
            client.reattach_timeout_s = 30.0
            assert np.array_equal(client.gather(ids), table.rows[ids])
        assert local.is_local and not remote.is_local
    finally:
        reader.close()
        local.close()
        remote.close()
        second.stop()
    assert not _segment_exists(second)


def test_segment_of_a_killed_service_is_retired_by_the_next_one(small_fp8_table: TableFile) -> None:
    table = small_fp8_table
    ids = np.arange(32).reshape(2, HEADS)
    killed = ServiceProcess(table.path).start()
    client = PleTableClient(killed.address, reattach_timeout_s=30.0)
    successor = ServiceProcess(table.path, shm_name=killed.shm_name, port=killed.port)
    try:
        old_generation = client.info.generation
        killed.stop(signal.SIGKILL)
        assert _segment_exists(killed), "a killed service cannot clean up"
        successor.start()
        assert np.array_equal(client.gather(ids), table.rows[ids])
        assert client.info.generation != old_generation and client.is_local
    finally:
        client.close()
        successor.stop()
    assert not _segment_exists(successor)
