"""gRPC transport for the PLE service: Describe, Lookup and LookupStream over the loaded
segment."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
from backport.v1 import ple_pb2
from google.protobuf.message import DecodeError

from services.mesh.channels import MAX_MESSAGE_BYTES
from services.mesh.service_names import PLE_GRPC
from services.ple_offload.errors import RowIdError
from services.ple_offload.lookup_wire import encode_lookup_reply, max_rows_per_reply
from services.ple_offload.row_gather import check_row_ids
from services.ple_offload.table_segment import TableSegment

# Gathers larger than this run on a worker thread so one prefill batch cannot stall
# the decode-step lookups of other engines (1 M rows x 160 B is about 10 ms of copying).
_INLINE_GATHER_ROWS = 65_536


class PleOffloadServicer:
    def __init__(self, segment: TableSegment) -> None:
        self._segment = segment
        self._is_stopping = False
        # The handler tasks of LookupStreams that are waiting for their next request.
        self._idle_streams: set[asyncio.Task[object]] = set()
        source = segment.source
        self._info = ple_pb2.TableInfo(
            tensor_name=source.tensor_name,
            num_rows=source.num_rows,
            row_width=source.row_width,
            row_bytes=source.row_bytes,
            dtype=int(source.dtype),
            scale=source.scale,
            header_sha256=source.header_sha256,
            shm_name=segment.shm_name,
            shm_dir=str(segment.shm_dir),
            generation=segment.generation,
        )

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers the service. Lookup replies are returned already serialized (see
        `lookup_wire.encode_lookup_reply`), so those handlers have no response serializer.
        Lookup requests arrive as bytes and are parsed in `_reply`: grpc's own deserializer
        answers bytes that are no LookupRequest with UNKNOWN and logs a traceback."""
        handlers = {
            "Describe": grpc.unary_unary_rpc_method_handler(
                self.Describe, request_deserializer=ple_pb2.DescribeRequest.FromString,
                response_serializer=ple_pb2.TableInfo.SerializeToString),
            "Lookup": grpc.unary_unary_rpc_method_handler(
                self.Lookup, request_deserializer=None, response_serializer=None),
            "LookupStream": grpc.stream_stream_rpc_method_handler(
                self.LookupStream, request_deserializer=None, response_serializer=None),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(PLE_GRPC, handlers),))

    async def Describe(self, request: ple_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> ple_pb2.TableInfo:
        if not self._segment.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "PLE table is not loaded")
        return self._info

    async def Lookup(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """A serialized LookupResponse."""
        return await self._reply(request, context)

    async def LookupStream(self, requests: AsyncIterator[bytes],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """One serialized LookupResponse per request, in order. A request Lookup would
        refuse aborts the stream with Lookup's status. Once the service stops, a stream
        ends with UNAVAILABLE after its in-flight lookup (see `end_streams`)."""
        task = asyncio.current_task()
        assert task is not None  # grpc runs every handler in a task
        while not self._is_stopping:
            self._idle_streams.add(task)
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return  # the client half-closed: end the stream with OK
            except asyncio.CancelledError:
                if not self._is_stopping:
                    raise  # the client cancelled
                break
            finally:
                self._idle_streams.discard(task)
            yield await self._reply(request, context)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "PLE service is stopping")

    def end_streams(self) -> None:
        """Ends every LookupStream with UNAVAILABLE: idle ones now, busy ones after their
        lookup. Without this the server's graceful stop would wait `grace_s` for streams
        that clients keep open between lookups. grpc does not end an RPC whose handler
        task is cancelled, so the cancelled handler aborts the call itself."""
        self._is_stopping = True
        for task in self._idle_streams:
            task.cancel()

    async def _reply(self, request_bytes: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """The serialized LookupResponse to the serialized LookupRequest `request_bytes`, or
        the call aborted with UNAVAILABLE (table not ready), INVALID_ARGUMENT (not a
        LookupRequest, bad ids) or RESOURCE_EXHAUSTED (a reply over grpc's message limit)."""
        rows = self._segment.rows
        if rows is None or not self._segment.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "PLE table is not loaded")
        try:
            request = ple_pb2.LookupRequest.FromString(request_bytes)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a LookupRequest: {exc}")
        packed_ids = request.row_ids_le_i64  # each read of the field copies it
        if len(packed_ids) % 8:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "row_ids_le_i64 must hold whole little-endian int64 values")
        ids = np.frombuffer(packed_ids, dtype="<i8")
        max_rows = max_rows_per_reply(rows.shape[1])
        if ids.size > max_rows:
            # Refused before gathering: grpc would fail the reply only once it was built
            # (and log the failure as a servicer error), after gigabytes of copying.
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a lookup of {ids.size} rows of {rows.shape[1]} B exceeds the "
                f"{MAX_MESSAGE_BYTES} B message limit; send at most {max_rows} rows a request")
        try:
            check_row_ids(ids, rows.shape[0])
        except RowIdError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if ids.size > _INLINE_GATHER_ROWS:
            return await asyncio.to_thread(encode_lookup_reply, rows, ids,
                                           self._segment.generation)
        return encode_lookup_reply(rows, ids, self._segment.generation)

