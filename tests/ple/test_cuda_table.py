"""GPU gathers straight from the shared table: a real PLE service, its segment registered
with the CUDA driver, rows gathered by the GPU bit for bit equal to the file's, and the
registration dropped and made again when the service restarts. Skips without CUDA."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.ple_offload.client import PleTableClient
from services.ple_offload.errors import RowIdError, TableUnavailableError
from services.ple_offload.segment_layout import DATA_OFFSET_BYTES
from tests.ple.service_process import ServiceProcess
from tests.ple.table_files import TableFile

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from services.ple_offload.cuda_table import host_registered  # noqa: E402

HEADS = 16


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module", params=["fp8", "bf16"])
def served_table(request: pytest.FixtureRequest) -> Iterator[tuple[TableFile, ServiceProcess]]:
    table: TableFile = request.getfixturevalue(f"{request.param}_table")
    with ServiceProcess(table.path) as service:
        yield table, service


def _registered(client: PleTableClient, device: torch.device) -> int:
    """The address of the client's registered mapping, checked with the driver."""
    assert client.cuda_table is not None, client.cuda_unavailable_reason
    address = client.cuda_table.address
    assert address is not None and host_registered(address, device)
    return address


def test_gpu_gather_equals_the_file(served_table: tuple[TableFile, ServiceProcess],
                                    device: torch.device) -> None:
    table, service = served_table
    num_rows = table.rows.shape[0]
    client = PleTableClient(service.address)
    try:
        allocated_before = torch.cuda.memory_allocated(device)
        assert client.enable_cuda(device), client.cuda_unavailable_reason
        address = _registered(client, device)
        rows = client.cuda_table.rows
        # Zero-copy: the CUDA tensor is the shared mapping, and no table was allocated.
        assert rows.is_cuda and rows.data_ptr() == address + DATA_OFFSET_BYTES
        assert tuple(rows.shape) == table.rows.shape
        assert torch.cuda.memory_allocated(device) == allocated_before

        rng = np.random.default_rng(3)
        for tokens in (64, 4096, 1):
            ids = rng.integers(0, num_rows, (tokens, HEADS))
            ids[0, :2] = (0, num_rows - 1)  # the first and the last row
            got = client.gather_cuda(torch.from_numpy(ids).to(device))
            assert got.device == device and got.dtype == torch.uint8
            assert np.array_equal(got.cpu().numpy(), table.rows[ids]), f"{tokens} tokens"

        # int32 ids, and an ETP shard: rows outside [start, end) are zero.
        ids = rng.integers(0, num_rows, (64, HEADS))
        ids[0, :2] = (0, num_rows - 1)
        start, end = num_rows // 4, num_rows // 2
        got = client.gather_cuda(torch.from_numpy(ids).to(device, torch.int32), start, end)
        expected = table.rows[ids]
        expected[(ids < start) | (ids >= end)] = 0
        assert np.array_equal(got.cpu().numpy(), expected)
        # Float ids are refused, as on the host path, not cast to the row below them.
        with pytest.raises(RowIdError, match="integers"):
            client.gather_cuda(torch.tensor([[1.7]], device=device))
    finally:
        client.close()
    assert not host_registered(address, device), "close() must unregister the mapping"


def test_without_shared_memory_the_host_gathers_and_copies(
        served_table: tuple[TableFile, ServiceProcess], device: torch.device) -> None:
    table, service = served_table
    client = PleTableClient(service.address, allow_shared_memory=False)
    try:
        assert not client.enable_cuda(device)
        assert "gRPC" in (client.cuda_unavailable_reason or "")
        ids = np.array([[0, table.rows.shape[0] - 1, 5]])
        got = client.gather_cuda(torch.from_numpy(ids).to(device))
        assert got.device == device and np.array_equal(got.cpu().numpy(), table.rows[ids])
    finally:
        client.close()


def test_restart_unregisters_then_reattach_registers_again(small_fp8_table: TableFile,
                                                           device: torch.device) -> None:
    table = small_fp8_table
    ids = np.random.default_rng(8).integers(0, table.rows.shape[0], (64, HEADS))
    ids[0, :2] = (0, table.rows.shape[0] - 1)
    gpu_ids = torch.from_numpy(ids).to(device)
    first = ServiceProcess(table.path).start()
    client = PleTableClient(first.address, reattach_timeout_s=0.5)
    services = [first]
    try:
        assert client.enable_cuda(device), client.cuda_unavailable_reason
        old_address = _registered(client, device)
        assert np.array_equal(client.gather_cuda(gpu_ids).cpu().numpy(), table.rows[ids])

        # Service gone: the client detaches (unpins, unmaps) and says so.
        first.stop(signal.SIGTERM)
        with pytest.raises(TableUnavailableError, match="did not come back within 0.5 s"):
            client.gather_cuda(gpu_ids)
        assert client.cuda_table is None
        assert not host_registered(old_address, device)

        # A new service under the same name: the next gather reattaches and registers
        # the new generation's mapping.
        services.append(ServiceProcess(table.path, shm_name=first.shm_name, port=first.port).start())
        client.reattach_timeout_s = 30.0
        assert np.array_equal(client.gather_cuda(gpu_ids).cpu().numpy(), table.rows[ids])
        assert np.array_equal(client.gather_cuda(gpu_ids).cpu().numpy(), table.rows[ids])
        generation = client.info.generation
        _registered(client, device)

        # Restart while attached and registered: one call finds the segment CLOSED,
        # unregisters, reattaches, registers again and gathers on the GPU.
        services[-1].stop(signal.SIGTERM)
        services.append(ServiceProcess(table.path, shm_name=first.shm_name, port=first.port).start())
        assert np.array_equal(client.gather_cuda(gpu_ids).cpu().numpy(), table.rows[ids])
        assert client.info.generation != generation
        last_address = _registered(client, device)
    finally:
        client.close()
        for service in services:
            service.stop()
    assert not host_registered(last_address, device)


def test_an_idle_client_unregisters_a_closed_segment(small_fp8_table: TableFile,
                                                     device: torch.device) -> None:
    """The driver pins the registered pages: an engine that makes no gather after the
    service stopped must still let them go (before, they stayed pinned until its next
    gather), and the next gather registers the successor's table."""
    table = small_fp8_table
    ids = np.arange(64 * HEADS).reshape(64, HEADS)
    gpu_ids = torch.from_numpy(ids).to(device)
    first = ServiceProcess(table.path).start()
    client = PleTableClient(first.address, reattach_timeout_s=30.0)
    second = ServiceProcess(table.path, shm_name=first.shm_name, port=first.port)
    try:
        assert client.enable_cuda(device), client.cuda_unavailable_reason
        old_address = _registered(client, device)
        assert np.array_equal(client.gather_cuda(gpu_ids).cpu().numpy(), table.rows[ids])
        first.stop(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while host_registered(old_address, device) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not host_registered(old_address, device), "the closed table stayed pinned"
        second.start()
        assert np.array_equal(client.gather_cuda(gpu_ids).cpu().numpy(), table.rows[ids])
        last_address = _registered(client, device)
    finally:
        client.close()
        first.stop()
        second.stop()
    assert not host_registered(last_address, device)


def test_a_table_first_reached_over_grpc_is_registered_once_reattached_here(
        small_fp8_table: TableFile, device: torch.device, tmp_path: Path) -> None:
    """What the PLE hook relies on when it asks `enable_cuda` again after a reattach: a
    client that first reached the table over gRPC (its segment not on this machine)
    registers the shared table once a restarted service has it here, and its GPU gathers
    then make no host sync, where the host gather + copy does."""
    table = small_fp8_table
    ids = np.random.default_rng(9).integers(0, table.rows.shape[0], (64, HEADS))
    gpu_ids = torch.from_numpy(ids).to(device)
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    elsewhere = tmp_path / "shm-of-another-machine"
    first = ServiceProcess(table.path, extra_args=("--shm-dir", str(shm_dir))).start()
    services = [first]
    try:
        shm_dir.rename(elsewhere)
        client = PleTableClient(first.address, reattach_timeout_s=30.0)
        try:
            assert not client.is_local
            assert not client.enable_cuda(device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    client.gather_cuda(gpu_ids)
            finally:
                torch.cuda.set_sync_debug_mode("default")

            elsewhere.rename(shm_dir)
            first.stop()
            services.append(ServiceProcess(table.path, shm_name=first.shm_name, port=first.port,
                                           extra_args=("--shm-dir", str(shm_dir))).start())
            assert np.array_equal(client.gather_cuda(gpu_ids).cpu().numpy(), table.rows[ids])
            assert client.is_local
            assert client.enable_cuda(device), client.cuda_unavailable_reason
            _registered(client, device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                gathered = client.gather_cuda(gpu_ids)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert np.array_equal(gathered.cpu().numpy(), table.rows[ids])
        finally:
            client.close()
    finally:
        for service in services:
            service.stop()
