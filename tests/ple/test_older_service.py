"""A client against a service that predates LookupStream: the first gather is answered
UNIMPLEMENTED on the stream, and the client switches to unary Lookup for good."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest
from backport.v1 import ple_pb2

from services.ple_offload.client import PleTableClient
from services.ple_offload.lookup_wire import LOOKUP_METHOD, LOOKUP_STREAM_METHOD, encode_lookup_reply
from services.mesh.service_names import PLE_GRPC
from tests.conftest import free_port

ROW_BYTES = 160
GENERATION = 0x1234
TABLE_ROWS = np.random.default_rng(12).integers(0, 256, (3000, ROW_BYTES), dtype=np.uint8)
DESCRIBE_METHOD = f"/{PLE_GRPC}/Describe"


class _MethodLog(grpc.ServerInterceptor):
    """Every method a client called, in order, registered or not."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        self.methods.append(handler_call_details.method)
        return continuation(handler_call_details)


def _describe(request: ple_pb2.DescribeRequest, context: grpc.ServicerContext) -> ple_pb2.TableInfo:
    return ple_pb2.TableInfo(tensor_name="t", num_rows=TABLE_ROWS.shape[0], row_width=ROW_BYTES,
                             row_bytes=ROW_BYTES, dtype=ple_pb2.ROW_DTYPE_FLOAT8_E4M3FN,
                             shm_name="backport-ple-test-not-on-this-machine",
                             generation=GENERATION)


def _lookup(request: ple_pb2.LookupRequest, context: grpc.ServicerContext) -> bytes:
    return encode_lookup_reply(TABLE_ROWS, np.frombuffer(request.row_ids_le_i64, "<i8"), GENERATION)


@pytest.fixture
def older_service() -> Iterator[tuple[str, _MethodLog]]:
    """A real gRPC server with the contract before LookupStream: Describe and Lookup only."""
    log = _MethodLog()
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=(log,))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PLE_GRPC, {
        "Describe": grpc.unary_unary_rpc_method_handler(
            _describe, request_deserializer=ple_pb2.DescribeRequest.FromString,
            response_serializer=ple_pb2.TableInfo.SerializeToString),
        "Lookup": grpc.unary_unary_rpc_method_handler(
            _lookup, request_deserializer=ple_pb2.LookupRequest.FromString),
    }),))
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    yield address, log
    server.stop(0)


def test_a_service_without_lookup_stream_gets_unary_lookups(
        older_service: tuple[str, _MethodLog]) -> None:
    address, log = older_service
    client = PleTableClient(address, allow_shared_memory=False, reattach_timeout_s=1.0)
    try:
        rng = np.random.default_rng(5)
        for _ in range(3):
            ids = rng.integers(0, TABLE_ROWS.shape[0], (64, 16))
            assert np.array_equal(client.gather(ids), TABLE_ROWS[ids])
    finally:
        client.close()
    # One stream attempt (the client's probe rows at construction), then only unary
    # lookups: no reattach (no second Describe) and no stream asked for again.
    assert log.methods == [DESCRIBE_METHOD, LOOKUP_STREAM_METHOD] + [LOOKUP_METHOD] * 4
