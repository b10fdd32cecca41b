"""LookupResponse wire bytes: the service's layout is read in place, and any other valid
encoding (protobuf's own, which writes the rows first) is still read right, alone and
through a PleTableClient talking to a real gRPC server."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
from backport.v1 import ple_pb2, ple_pb2_grpc
from google.protobuf.message import DecodeError

from services.ple_offload.client import PleTableClient
from services.ple_offload.lookup_wire import decode_lookup_reply, encode_lookup_reply
from tests.conftest import free_port

ROW_BYTES = 160
GENERATION = 0xFEDCBA9876543210
TABLE_ROWS = np.random.default_rng(11).integers(0, 256, (5000, ROW_BYTES), dtype=np.uint8)


@pytest.mark.parametrize("num_ids", [0, 1, 1024])
def test_the_services_layout_is_read_in_place(num_ids: int) -> None:
    ids = np.random.default_rng(num_ids).integers(0, TABLE_ROWS.shape[0], num_ids)
    reply = encode_lookup_reply(TABLE_ROWS, ids, GENERATION)

    parsed_by_protobuf = ple_pb2.LookupResponse.FromString(reply)
    assert parsed_by_protobuf.generation == GENERATION
    assert parsed_by_protobuf.rows == TABLE_ROWS[ids].tobytes()

    generation, rows = decode_lookup_reply(reply)
    assert generation == GENERATION
    assert np.array_equal(rows.reshape(num_ids, ROW_BYTES), TABLE_ROWS[ids])
    assert num_ids == 0 or np.shares_memory(rows, np.frombuffer(reply, np.uint8))


@pytest.mark.parametrize("reply", [
    # protobuf writes fields in field-number order: rows (1) before generation (2)
    ple_pb2.LookupResponse(rows=TABLE_ROWS[:3].tobytes(), generation=GENERATION),
    ple_pb2.LookupResponse(rows=TABLE_ROWS[:3].tobytes(), generation=0),  # generation omitted
    ple_pb2.LookupResponse(generation=GENERATION),  # rows omitted
], ids=["rows-first", "no-generation", "no-rows"])
def test_other_valid_encodings_fall_back_to_protobuf(reply: ple_pb2.LookupResponse) -> None:
    wire = reply.SerializeToString()
    generation, rows = decode_lookup_reply(wire)
    assert generation == reply.generation
    assert rows.tobytes() == reply.rows
    assert not np.shares_memory(rows, np.frombuffer(wire, np.uint8))  # parsed, not viewed


def test_generation_then_rows_followed_by_another_field_falls_back() -> None:
    """The service's layout with one more field after the rows: the rows no longer run to
    the end, so the fast path must not take them."""
    wire = encode_lookup_reply(TABLE_ROWS, np.arange(4), GENERATION)
    repeated_generation = ple_pb2.LookupResponse(generation=7).SerializeToString()
    generation, rows = decode_lookup_reply(wire + repeated_generation)
    assert generation == 7  # the last value of a repeated scalar field wins
    assert rows.tobytes() == TABLE_ROWS[:4].tobytes()


def test_a_truncated_reply_raises() -> None:
    wire = encode_lookup_reply(TABLE_ROWS, np.arange(4), GENERATION)
    with pytest.raises(DecodeError):
        decode_lookup_reply(wire[:-1])


class _ProtobufEncodedService(ple_pb2_grpc.PleOffloadServicer):
    """A PleOffload that answers with protobuf's own encoding of each message."""

    def Describe(self, request: ple_pb2.DescribeRequest,
                 context: grpc.ServicerContext) -> ple_pb2.TableInfo:
        return ple_pb2.TableInfo(tensor_name="t", num_rows=TABLE_ROWS.shape[0], row_width=ROW_BYTES,
                                 row_bytes=ROW_BYTES, dtype=ple_pb2.ROW_DTYPE_FLOAT8_E4M3FN,
                                 shm_name="backport-ple-test-not-on-this-machine",
                                 generation=GENERATION)

    def Lookup(self, request: ple_pb2.LookupRequest,
               context: grpc.ServicerContext) -> ple_pb2.LookupResponse:
        ids = np.frombuffer(request.row_ids_le_i64, "<i8")
        return ple_pb2.LookupResponse(rows=TABLE_ROWS[ids].tobytes(), generation=GENERATION)

    def LookupStream(self, request_iterator: Iterator[ple_pb2.LookupRequest],
                     context: grpc.ServicerContext) -> Iterator[ple_pb2.LookupResponse]:
        for request in request_iterator:
            yield self.Lookup(request, context)


@pytest.fixture(scope="module")
def protobuf_encoded_service() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    ple_pb2_grpc.add_PleOffloadServicer_to_server(_ProtobufEncodedService(), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    yield address
    server.stop(0)


@pytest.mark.parametrize("lookup_stream", [True, False], ids=["stream", "unary"])
def test_the_client_reads_protobufs_own_encoding(protobuf_encoded_service: str,
                                                  lookup_stream: bool) -> None:
    client = PleTableClient(protobuf_encoded_service, allow_shared_memory=False,
                            lookup_stream=lookup_stream)
    try:
        ids = np.random.default_rng(3).integers(0, TABLE_ROWS.shape[0], (64, 16))
        assert np.array_equal(client.gather(ids), TABLE_ROWS[ids])
    finally:
        client.close()
