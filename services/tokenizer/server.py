"""Entry point of the tokenizer service."""

from __future__ import annotations

import asyncio

from backport.v1 import tokenizer_pb2_grpc
from services.mesh.grpc_server import GrpcServer
from services.mesh.service_names import TOKENIZER_GRPC
from services.tokenizer.core import TokenizerCore
from services.tokenizer.servicer import TokenizerServicer
from services.tokenizer.settings import TokenizerSettings


async def serve(settings: TokenizerSettings) -> None:
    core = await asyncio.to_thread(TokenizerCore, settings.model,
                                   trust_remote_code=settings.trust_remote_code)
    server = GrpcServer(TOKENIZER_GRPC, f"{settings.host}:{settings.port}", grace_s=5.0)
    server.add(lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(core), s))
    await server.start()
    await server.serve_until_signal()
