"""A gather whose rows pass grpc's 256 MiB message limit: the client splits it over several
lookups, and the service refuses one such lookup before it gathers anything."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from backport.v1 import ple_pb2, ple_pb2_grpc

from services.mesh.channels import GRPC_OPTIONS, MAX_MESSAGE_BYTES
from services.ple_offload.client import PleTableClient
from services.ple_offload.lookup_wire import max_rows_per_reply
from tests.ple.service_process import ServiceProcess
from tests.ple.table_files import TableFile


def test_a_gather_past_the_message_limit_is_split_over_lookups(
        small_fp8_table: TableFile) -> None:
    """About 1.7 M rows of 160 B (a 131 k-token prefill at 16 heads): one reply would be
    272 MB. Before, the reply failed with RESOURCE_EXHAUSTED, which the client took for a
    lost table, reattached and raised TableUnavailableError."""
    table = small_fp8_table
    num_ids = max_rows_per_reply(table.rows.shape[1]) + 1000
    assert num_ids * table.rows.shape[1] > MAX_MESSAGE_BYTES
    ids = np.random.default_rng(5).integers(0, table.rows.shape[0], (num_ids // 16, 16))
    with ServiceProcess(table.path) as service:
        client = PleTableClient(service.address, allow_shared_memory=False,
                                reattach_timeout_s=1.0)
        try:
            rows = client.gather(ids)
            assert rows.shape == (*ids.shape, table.rows.shape[1])
            assert np.array_equal(rows, table.rows[ids])
        finally:
            client.close()
        log = service.stop()
    assert "Traceback" not in log, log


def test_the_service_refuses_a_lookup_past_the_message_limit_before_gathering(
        small_fp8_table: TableFile) -> None:
    """A client that does not split (any protobuf client) gets RESOURCE_EXHAUSTED that says
    how many rows fit, and the service logs no servicer error. Before, it gathered all the
    rows, then grpc refused to send them and logged an ExecuteBatchError traceback."""
    table = small_fp8_table
    max_rows = max_rows_per_reply(table.rows.shape[1])
    ids = np.zeros(max_rows + 1, "<i8")
    with ServiceProcess(table.path) as service:
        with grpc.insecure_channel(service.address, options=GRPC_OPTIONS) as channel:
            stub = ple_pb2_grpc.PleOffloadStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Lookup(ple_pb2.LookupRequest(row_ids_le_i64=ids.tobytes()), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"send at most {max_rows} rows a request" in refused.value.details()
            fits = stub.Lookup(ple_pb2.LookupRequest(row_ids_le_i64=ids[:max_rows].tobytes()),
                               timeout=30)
            assert len(fits.rows) == max_rows * table.rows.shape[1]
        log = service.stop()
    assert "Traceback" not in log, log
