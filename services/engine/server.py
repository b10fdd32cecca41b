"""Entry point of the engine service."""

from __future__ import annotations

import asyncio
import logging

from backport.v1 import engine_pb2_grpc
from services.engine.servicer import EngineServicer
from services.engine.settings import EngineSettings
from services.engine.vllm_engine import VllmEngine
from services.mesh.grpc_server import GrpcServer

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5


async def serve(settings: EngineSettings) -> None:
    engine = VllmEngine(settings)
    server = GrpcServer("backport.v1.Engine", f"{settings.host}:{settings.port}",
                        grace_s=settings.drain_timeout_s)
    server.add(lambda s: engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), s))
    engine.start()
    await server.start()
    watcher = asyncio.create_task(_watch_engine_core(engine, server))
    try:
        await server.serve_until_signal()
    finally:
        watcher.cancel()
        engine.shutdown()


async def _watch_engine_core(engine: VllmEngine, server: GrpcServer) -> None:
    """Health turns NOT_SERVING when vLLM's engine core dies; the gateway routes away."""
    while engine.is_healthy:
        await asyncio.sleep(HEALTH_POLL_S)
    logger.error("vLLM engine core died; health is now NOT_SERVING")
    await server.set_serving(False)
