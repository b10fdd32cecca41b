"""gRPC transport for the PLE service: Describe and Lookup over the loaded segment."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
from backport.v1 import ple_pb2, ple_pb2_grpc

from services.ple_offload.errors import RowIdError
from services.ple_offload.table_reader import check_row_ids
from services.ple_offload.table_segment import TableSegment

# Gathers larger than this run on a worker thread so one prefill batch cannot stall
# the decode-step lookups of other engines (1 M rows x 160 B is about 10 ms of copying).
_INLINE_GATHER_ROWS = 65_536


class PleOffloadServicer(ple_pb2_grpc.PleOffloadServicer):
    def __init__(self, segment: TableSegment) -> None:
        self._segment = segment
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
            generation=segment.generation,
        )

    async def Describe(self, request: ple_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> ple_pb2.TableInfo:
        if not self._segment.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "PLE table is not loaded")
        return self._info

    async def Lookup(self, request: ple_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> ple_pb2.LookupResponse:
        rows = self._segment.rows
        if rows is None or not self._segment.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "PLE table is not loaded")
        if len(request.row_ids_le_i64) % 8:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "row_ids_le_i64 must hold whole little-endian int64 values")
        ids = np.frombuffer(request.row_ids_le_i64, dtype="<i8")
        try:
            check_row_ids(ids, rows.shape[0])
        except RowIdError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if ids.size > _INLINE_GATHER_ROWS:
            gathered = await asyncio.to_thread(np.take, rows, ids, 0)
        else:
            gathered = np.take(rows, ids, axis=0)
        return ple_pb2.LookupResponse(rows=gathered.tobytes(), generation=self._segment.generation)
