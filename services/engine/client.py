"""Typed async client of the engine service; imports no torch or vllm."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from backport.v1 import engine_pb2 as pb
from backport.v1 import engine_pb2_grpc
from services.mesh.channels import open_channel


class EngineClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = open_channel(address)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)

    def generate(self, request: pb.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        """The response stream; cancel the returned call to abort the request."""
        return self.stub.Generate(request)

    async def abort(self, request_id: str, choice_indexes: Sequence[int] = ()) -> None:
        """Aborts the request, or only these choices of it (its call goes on with the others)."""
        await self.stub.Abort(pb.AbortRequest(request_id=request_id, choice_indexes=choice_indexes),
                              timeout=5.0)

    async def model_info(self, timeout_s: float = 10.0) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)

    async def loads(self, timeout_s: float = 2.0) -> pb.Loads:
        return await self.stub.GetLoads(pb.GetLoadsRequest(), timeout=timeout_s)

    def watch_kv_events(self) -> grpc.aio.UnaryStreamCall:
        """A snapshot of the engine's held KV blocks, then each batch of changes; cancel to stop."""
        return self.stub.WatchKvEvents(pb.WatchKvEventsRequest())

    async def close(self) -> None:
        await self.channel.close()

