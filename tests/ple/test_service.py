"""The served rows are the file's rows, over shared memory, LookupStream and unary Lookup,
and survive restarts."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from backport.v1 import ple_pb2

from services.mesh.channels import GRPC_OPTIONS
from services.ple_offload.client import PleTableClient
from services.ple_offload.errors import RowIdError, TableClosedError, TableUnavailableError
from services.ple_offload.lookup_wire import (
    LOOKUP_METHOD,
    LOOKUP_STREAM_METHOD,
    decode_lookup_reply,
)
from services.ple_offload.table_format import find_table
from services.ple_offload.table_reader import SharedTableReader
from tests.conftest import free_port
from tests.ple.service_process import (
    REPO_ROOT,
    ServiceProcess,
    service_command,
    service_env,
    unique_shm_name,
)
from tests.ple.table_files import TableFile, random_rows, write_sparse_table, write_table

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


def _clients(address: str, **options: float) -> dict[str, PleTableClient]:
    """One client per way rows travel: shared memory, LookupStream, unary Lookup."""
    return {"shm": PleTableClient(address, gather_threads=2, **options),
            "stream": PleTableClient(address, allow_shared_memory=False, **options),
            "unary": PleTableClient(address, allow_shared_memory=False, lookup_stream=False,
                                    **options)}


def test_rows_equal_the_file_under_concurrent_callers(
        served_table: tuple[TableFile, ServiceProcess]) -> None:
    table, service = served_table
    clients = _clients(service.address)
    try:
        assert clients["shm"].is_local and not clients["stream"].is_local
        assert not clients["unary"].is_local
        for client in clients.values():
            assert client.row_bytes == table.rows.shape[1]
            assert client.num_rows == table.rows.shape[0]
        if table.scale is not None:
            assert clients["shm"].info.scale == pytest.approx(table.scale)
        edge_ids = np.array([[0, table.rows.shape[0] - 1]])
        for client in clients.values():
            assert np.array_equal(client.gather(edge_ids), table.rows[edge_ids])
        with ThreadPoolExecutor(len(clients) * NUM_CALLERS) as pool:
            futures = [pool.submit(_caller, client, table.rows, seed)
                       for seed in range(NUM_CALLERS) for client in clients.values()]
            assert sum(f.result() for f in futures) == (
                len(clients) * NUM_CALLERS * 10 * HEADS * sum(BATCH_TOKENS))
    finally:
        for client in clients.values():
            client.close()


def test_out_of_range_ids_are_refused_and_the_next_lookup_works(
        served_table: tuple[TableFile, ServiceProcess]) -> None:
    """Over LookupStream a refused id ends the stream; the next gather opens another."""
    table, service = served_table
    good_ids = np.array([[1, table.rows.shape[0] - 2]])
    clients = _clients(service.address)
    try:
        for client in clients.values():
            for bad in (-1, table.rows.shape[0]):
                with pytest.raises(RowIdError, match=re.escape(
                        f"row ids out of range [0, {table.rows.shape[0]}): [{bad}]")):
                    client.gather(np.array([[0, bad]]))
                assert np.array_equal(client.gather(good_ids), table.rows[good_ids])
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.parametrize(("body", "message"), [
    (b"\xff\xff\xff", "the request is not a LookupRequest"),
    (ple_pb2.LookupRequest(row_ids_le_i64=bytes(7)).SerializeToString(),
     "row_ids_le_i64 must hold whole little-endian int64 values"),
], ids=["not protobuf", "ids not whole int64s"])
def test_a_malformed_request_is_refused_by_name(small_fp8_table: TableFile, body: bytes,
                                                message: str) -> None:
    """Any gRPC client may send bytes that are no LookupRequest: unary Lookup and
    LookupStream answer INVALID_ARGUMENT and the service logs no traceback. Before, grpc's
    deserializer failed the call with UNKNOWN (which PleTableClient takes for a lost table)
    and the service logged a DecodeError traceback."""
    table = small_fp8_table
    good = ple_pb2.LookupRequest(row_ids_le_i64=np.array([3, 7], "<i8").tobytes())
    with ServiceProcess(table.path) as service:
        with grpc.insecure_channel(service.address, options=GRPC_OPTIONS) as channel:
            lookup = channel.unary_unary(LOOKUP_METHOD)
            lookup_stream = channel.stream_stream(LOOKUP_STREAM_METHOD)
            for call in (lambda: lookup(body, timeout=10),
                         lambda: list(lookup_stream(iter([body]), timeout=10))):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert message in refused.value.details()
            _, rows = decode_lookup_reply(lookup(good.SerializeToString(), timeout=10))
            assert np.array_equal(rows.reshape(2, -1), table.rows[[3, 7]])
        log = service.stop()
    assert "Traceback" not in log, log


def test_ids_that_are_not_integers_are_refused(small_fp8_table: TableFile) -> None:
    """Over shared memory, LookupStream and unary Lookup. Before, the ids were cast to
    int64 and 1.7 silently got row 1."""
    table = small_fp8_table
    with ServiceProcess(table.path) as service:
        clients = _clients(service.address)
        try:
            for client in clients.values():
                with pytest.raises(RowIdError, match="row ids must be integers, got float64"):
                    client.gather(np.array([[1.7, 2.0]]))
                with pytest.raises(RowIdError, match="row ids must be integers, got float64"):
                    client.gather_owned(np.array([1.7]), 0, table.rows.shape[0])
                ids = np.array([[1, 2]], np.uint32)
                assert np.array_equal(client.gather(ids), table.rows[ids])
        finally:
            for client in clients.values():
                client.close()


def test_close_ends_every_lookup_stream(small_fp8_table: TableFile) -> None:
    """Concurrent callers each get a stream; close() leaves none of their threads (grpc's
    request senders, the channel's poller) running."""
    table = small_fp8_table
    ids = np.arange(64 * HEADS).reshape(64, HEADS)
    with ServiceProcess(table.path) as service:
        threads_before = set(threading.enumerate())
        client = PleTableClient(service.address, allow_shared_memory=False)
        with ThreadPoolExecutor(NUM_CALLERS) as pool:
            for rows in pool.map(lambda _: client.gather(ids), range(4 * NUM_CALLERS)):
                assert np.array_equal(rows, table.rows[ids])
        assert set(threading.enumerate()) - threads_before, "no stream threads to end"
        client.close()
        deadline = time.monotonic() + 5.0
        while (left := set(threading.enumerate()) - threads_before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"threads still running after close(): {sorted(t.name for t in left)}"


def _leave_idle_streams(client: PleTableClient, ids: np.ndarray) -> int:
    """Gathers from NUM_CALLERS threads at once until they have left several LookupStreams
    idle; returns how many."""
    streams = client._lookup_streams
    assert streams is not None
    barrier = threading.Barrier(NUM_CALLERS)

    def gather_together(_: int) -> np.ndarray:
        barrier.wait()
        return client.gather(ids)

    with ThreadPoolExecutor(NUM_CALLERS) as pool:
        for _ in range(5):
            list(pool.map(gather_together, range(NUM_CALLERS)))
            if len(streams._idle) > 1:
                break
    return len(streams._idle)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_restart_leaves_no_dead_stream_for_the_next_gather(small_fp8_table: TableFile,
                                                             sig: signal.Signals) -> None:
    """Every idle LookupStream dies with the service. After a restart the first gather
    reattaches and must then not retry on another dead stream: before, a client with four
    idle streams failed three gathers in a row with UNAVAILABLE."""
    table = small_fp8_table
    ids = np.arange(2048 * HEADS).reshape(2048, HEADS)
    first = ServiceProcess(table.path).start()
    client = PleTableClient(first.address, allow_shared_memory=False, reattach_timeout_s=30.0)
    second = ServiceProcess(table.path, shm_name=first.shm_name, port=first.port)
    try:
        assert _leave_idle_streams(client, ids) > 1, "the callers never overlapped"
        first.stop(sig)
        second.start()
        assert np.array_equal(client.gather(ids), table.rows[ids])
    finally:
        client.close()
        first.stop()
        second.stop()


def test_a_taken_address_stops_the_service_before_it_loads(tmp_path: Path) -> None:
    """The service listens before it copies the table: a taken port fails at once, not after
    minutes of loading tens of GiB (and while holding them)."""
    table_path = tmp_path / "sparse.safetensors"
    write_sparse_table(table_path, 4_000_000, 320)  # 1.2 GiB
    shm_name = unique_shm_name()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = subprocess.run(
            service_command(table_path, "--address", f"127.0.0.1:{taken.getsockname()[1]}",
                            "--shm-name", shm_name),
            cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "cannot listen on" in result.stderr, result.stderr
    assert f"ready in /dev/shm/{shm_name}" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not Path("/dev/shm", shm_name).exists()


def test_a_hung_service_fails_lookups_instead_of_hanging(small_fp8_table: TableFile) -> None:
    """A stopped (SIGSTOP) service answers nothing: a gather over an open stream fails
    within 2 x rpc_timeout_s plus the reattach wait, and works again once it resumes."""
    table = small_fp8_table
    ids = np.arange(64 * HEADS).reshape(64, HEADS)
    with ServiceProcess(table.path) as service:
        client = PleTableClient(service.address, allow_shared_memory=False, rpc_timeout_s=0.5,
                                reattach_timeout_s=0.5)
        try:
            assert np.array_equal(client.gather(ids), table.rows[ids])
            os.kill(service.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(TableUnavailableError, match="DEADLINE_EXCEEDED"):
                    client.gather(ids)
                # 1 s for the lookup, 0.5 s for the reattach wait plus one Describe
                # that may start just before it ends; the rest is slack for a busy machine.
                assert time.monotonic() - started < 5.0
            finally:
                os.kill(service.pid, signal.SIGCONT)
            client.reattach_timeout_s = 30.0
            assert np.array_equal(client.gather(ids), table.rows[ids])
        finally:
            client.close()


def _segment_exists(service: ServiceProcess) -> bool:
    return Path("/dev/shm", service.shm_name).exists()


def test_restart_gives_attached_clients_a_clear_error_then_they_reattach(
        small_fp8_table: TableFile) -> None:
    table = small_fp8_table
    ids = np.random.default_rng(7).integers(0, table.rows.shape[0], (64, HEADS))
    # A grace period far longer than the test: the remote client's idle lookup stream
    # must not hold the shutdown for it.
    first = ServiceProcess(table.path, extra_args=("--grace-s", "60")).start()
    reader = SharedTableReader(first.shm_name)
    local = PleTableClient(first.address, reattach_timeout_s=0.5)
    remote = PleTableClient(first.address, allow_shared_memory=False, reattach_timeout_s=0.5)
    second = ServiceProcess(table.path, shm_name=first.shm_name, port=first.port)
    try:
        for client in (local, remote):
            assert np.array_equal(client.gather(ids), table.rows[ids])
        stop_started = time.monotonic()
        log = first.stop(signal.SIGTERM)
        assert time.monotonic() - stop_started < 20.0, "an idle lookup stream held the shutdown"
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


def test_a_restart_on_other_rows_under_the_same_header_is_refused(tmp_path: Path) -> None:
    """The file changed between start and restart (new weights, same shapes): the header
    fingerprint is the same, the rows are not. Before, attached engines went on with the new
    rows under their old weights and fp8 scale, without a word."""
    shape = (20_000, 160)
    paths = [tmp_path / "before.safetensors", tmp_path / "after.safetensors"]
    tables = [write_table(path, random_rows(*shape, seed=seed), safetensors_dtype="F8_E4M3",
                          scale=0.5) for path, seed in zip(paths, (21, 22))]
    assert find_table(paths[0], None).header_sha256 == find_table(paths[1], None).header_sha256
    ids = np.arange(64 * HEADS).reshape(64, HEADS)
    first = ServiceProcess(paths[0]).start()
    clients = [PleTableClient(first.address, reattach_timeout_s=30.0),
               PleTableClient(first.address, allow_shared_memory=False, reattach_timeout_s=30.0)]
    second = ServiceProcess(paths[1], shm_name=first.shm_name, port=first.port)
    try:
        for client in clients:
            assert np.array_equal(client.gather(ids), tables[0].rows[ids])
        first.stop(signal.SIGTERM)
        second.start()
        for client in clients:
            for _ in range(2):  # and again: a refused table is not taken on the next gather
                with pytest.raises(TableUnavailableError, match="different table"):
                    client.gather(ids)
    finally:
        for client in clients:
            client.close()
        first.stop()
        second.stop()


def test_a_second_service_by_the_same_name_leaves_the_running_one_alone(
        small_fp8_table: TableFile) -> None:
    """Only a dead service's segment is retired: the running one holds a lock on its own,
    so a second start with its name stops before it touches it."""
    table = small_fp8_table
    ids = np.arange(32).reshape(2, HEADS)
    running = ServiceProcess(table.path).start()
    client = PleTableClient(running.address)
    try:
        generation = client.info.generation
        second = subprocess.run(
            service_command(table.path, "--address", f"127.0.0.1:{free_port()}",
                            "--shm-name", running.shm_name),
            cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert "belongs to a PLE service that is still running" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr, second.stderr
        assert np.array_equal(client.gather(ids), table.rows[ids])
        assert client.is_local and client.info.generation == generation
    finally:
        client.close()
        running.stop()
    assert not _segment_exists(running)


def test_sigterm_while_the_segment_is_made_removes_it(fp8_table: TableFile) -> None:
    """SIGTERM as soon as the segment's name appears (its memory is being reserved, or the
    first rows copied): the service stops cleanly and takes the segment with it."""
    shm_name = unique_shm_name()
    service = subprocess.Popen(
        service_command(fp8_table.path, "--address", f"127.0.0.1:{free_port()}",
                        "--shm-name", shm_name),
        cwd=REPO_ROOT, env=service_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    segment = Path("/dev/shm", shm_name)
    try:
        deadline = time.monotonic() + 60
        while not segment.exists():
            assert service.poll() is None, service.communicate()[0]
            assert time.monotonic() < deadline, "the service made no segment"
            time.sleep(0.001)
        service.send_signal(signal.SIGTERM)
        output, _ = service.communicate(timeout=60)
    finally:
        if service.poll() is None:
            service.kill()
    assert service.returncode == 0, output
    assert not segment.exists(), output
