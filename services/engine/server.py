"""Entry point of the engine service."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from backport.v1 import engine_pb2_grpc
from services.engine.kv_events import collector_for
from services.engine.metrics import EngineMetrics
from services.engine.registry import EngineRecord, EngineRegistration
from services.engine.servicer import EngineServicer
from services.engine.settings import EngineSettings
from services.engine.vllm_engine import VllmEngine
from services.mesh.grpc_server import GrpcServer
from services.mesh.service_names import ENGINE_GRPC

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5


class StartupInterrupted(BaseException):
    """SIGTERM or SIGINT arrived while vLLM was starting. A BaseException, as KeyboardInterrupt
    is: vLLM's startup code catches Exception in places and must not swallow it."""


async def serve(settings: EngineSettings) -> None:
    engine = VllmEngine(settings)
    metrics = EngineMetrics()
    server = GrpcServer(ENGINE_GRPC, f"{settings.host}:{settings.port}",
                        grace_s=settings.drain_timeout_s)
    kv_events = collector_for(settings.kv_events_endpoint)
    servicer = EngineServicer(engine, metrics, kv_events)
    server.add(lambda s: engine_pb2_grpc.add_EngineServicer_to_server(servicer, s))
    # Before the model loads: a taken port is refused in seconds, not once the load is done.
    if settings.metrics_port is not None:
        metrics.serve(settings.host, settings.metrics_port)
    registration = None
    if settings.redis_url:
        registration = EngineRegistration(settings.redis_url,
                                          lambda: _record(engine, server, settings))
    try:
        with _signals_interrupt_startup():
            engine.start()
    except StartupInterrupted as interruption:
        logger.info("stopped by %s while starting", interruption)
        engine.shutdown()
        return
    # From here the loop takes the signals: one before the server serves stops it at once.
    server.stop_on_signals()
    kv_event_collection = asyncio.create_task(kv_events.run()) if kv_events is not None else None
    watcher: asyncio.Task[None] | None = None
    try:
        await server.start()
        if registration is not None:
            await registration.start()
        watcher = asyncio.create_task(_watch_engine_core(engine, server, metrics, registration))

        async def drain() -> None:
            """SIGTERM: leave the registry before the server stops taking calls."""
            metrics.is_serving.set(0)
            if registration is not None:
                await registration.deregister()
            if kv_events is not None:
                kv_events.end_watches()

        metrics.is_serving.set(1)
        await server.serve_until_signal(on_stop=drain)
    finally:
        if watcher is not None:
            watcher.cancel()
        if kv_event_collection is not None:
            kv_event_collection.cancel()
        engine.shutdown()


@contextmanager
def _signals_interrupt_startup() -> Iterator[None]:
    """SIGTERM and SIGINT raise StartupInterrupted in the main thread while vLLM loads the
    model (a blocking call the event loop cannot interrupt). vLLM then stops the engine-core
    and worker processes it has started; the signal's default action would kill this process
    alone and leave them running, holding the model's memory."""
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise StartupInterrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _record(engine: VllmEngine, server: GrpcServer, settings: EngineSettings) -> EngineRecord:
    assert engine.info is not None
    loads = engine.loads()
    return EngineRecord(address=settings.advertise_address or f"{settings.host}:{server.port}",
                        model=engine.info.served_model_name,
                        max_model_len=engine.info.max_model_len, ttl_s=settings.registry_ttl_s,
                        num_running=loads.num_running, num_waiting=loads.num_waiting,
                        kv_cache_usage=loads.kv_cache_usage)


async def _watch_engine_core(engine: VllmEngine, server: GrpcServer, metrics: EngineMetrics,
                             registration: EngineRegistration | None) -> None:
    """Health turns NOT_SERVING when vLLM's engine core dies; the gateway routes away."""
    while engine.is_healthy:
        await asyncio.sleep(HEALTH_POLL_S)
    logger.error("vLLM engine core died; health is now NOT_SERVING")
    metrics.is_serving.set(0)
    await server.set_serving(False)
    if registration is not None:
        await registration.deregister()
