"""The PLE service asks grpc core for socket I/O on its polling threads (see
`services/mesh/grpc_io.py`), from both entry points, before grpc loads; an
operator's GRPC_EXPERIMENTS wins. Seen from outside: whether grpc's EventEngine threads
wake up for every LookupStream message (about 3 times with grpcio's default I/O, 0.1-0.2
times with polling-thread I/O on the development machine)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.ple_offload.client import PleTableClient
from services.mesh.grpc_io import GRPC_EXPERIMENTS_ENV, POLLING_THREAD_IO
from tests.ple.service_process import (
    CLI_ENTRY,
    MODULE_ENTRY,
    ServiceProcess,
    thread_status,
)
from tests.ple.table_files import TableFile

LOOKUPS = 300


def _event_engine_wakeups(pid: int) -> int:
    """Voluntary context switches of the process's threads that grpc names event_engine."""
    return sum(int(switches) for name, switches in thread_status(pid, "voluntary_ctxt_switches")
               if name == "event_engine")


def _event_engine_wakeups_per_lookup(service: ServiceProcess) -> float:
    ids = np.random.default_rng(7).integers(0, 100_000, (LOOKUPS, 64, 16))
    client = PleTableClient(service.address, allow_shared_memory=False)
    try:
        client.gather(ids[0])  # the stream is open before counting
        before = _event_engine_wakeups(service.pid)
        for step in ids:
            client.gather(step)
        return (_event_engine_wakeups(service.pid) - before) / LOOKUPS
    finally:
        client.close()


@pytest.mark.parametrize("entry", [MODULE_ENTRY, CLI_ENTRY], ids=["module", "backport-ple"])
def test_the_service_does_its_socket_io_on_grpcs_polling_threads(
        small_fp8_table: TableFile, entry: tuple[str, ...],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GRPC_EXPERIMENTS_ENV, raising=False)
    with ServiceProcess(small_fp8_table.path, entry=entry) as service:
        wakeups = _event_engine_wakeups_per_lookup(service)
        environ = Path(f"/proc/{service.pid}/environ").read_bytes()
    assert wakeups < 1, wakeups
    # The variable was set inside the service, not given to it.
    assert POLLING_THREAD_IO.encode() not in environ


def test_an_operators_grpc_experiments_are_kept(small_fp8_table: TableFile) -> None:
    """`event_engine_client` is on by default in grpcio 1.85: naming it keeps grpcio's own
    I/O, which is what the test above counts as absent."""
    with ServiceProcess(small_fp8_table.path,
                        extra_env={GRPC_EXPERIMENTS_ENV: "event_engine_client"}) as service:
        wakeups = _event_engine_wakeups_per_lookup(service)
    assert wakeups > 1, wakeups  # about 3 when idle; a busy machine's threads sleep less
