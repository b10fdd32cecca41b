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
from services.mesh.ports import is_port_free
from services.mesh.service_names import ENGINE_GRPC

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5
# The service's exit status once vLLM's engine core has died under it.
ENGINE_CORE_DIED_EXIT_STATUS = 1
# How long the service answers, NOT_SERVING, once its engine core has died: calls already on
# their way get its UNAVAILABLE naming the cause, not a refused connection.
ENGINE_CORE_DEATH_NOTICE_S = 2.0


class StartupInterrupted(BaseException):
    """SIGTERM or SIGINT arrived while vLLM was starting. A BaseException, as KeyboardInterrupt
    is: vLLM's startup code catches Exception in places and must not swallow it."""


async def serve(settings: EngineSettings) -> int:
    """Serves until a signal, or until vLLM's engine core dies; returns the exit status."""
    engine = VllmEngine(settings)
    metrics = EngineMetrics()
    server = GrpcServer(ENGINE_GRPC, f"{settings.host}:{settings.port}",
                        grace_s=settings.drain_timeout_s)
    kv_events = collector_for(settings.kv_events_endpoint)
    servicer = EngineServicer(engine, metrics, kv_events)
    server.add(lambda s: engine_pb2_grpc.add_EngineServicer_to_server(servicer, s))
    # Before the model loads: a taken port is refused in seconds, not once the load is done.
    # The gRPC port is checked, not held: grpc listens as soon as it binds (calls would hang
    # through the load), and vLLM's engine core, forked, would keep that socket open after the
    # service had closed it.
    if settings.port != 0 and not _can_listen(settings.host, settings.port):
        raise server.port_taken_error()
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
        return 0
    # From here the loop takes the signals: one before the server serves stops it at once.
    server.stop_on_signals()
    kv_event_collection = asyncio.create_task(kv_events.run()) if kv_events is not None else None
    watcher: asyncio.Task[None] | None = None
    try:
        await server.start()
        if registration is not None:
            await registration.start()
        watcher = asyncio.create_task(_stop_when_engine_core_dies(engine, server, metrics,
                                                                  registration))

        async def drain() -> None:
            """SIGTERM, or the engine core's death: leave the registry before the server stops
            taking calls."""
            metrics.is_serving.set(0)
            if registration is not None:
                await registration.deregister()
            if kv_events is not None:
                kv_events.end_watches()

        metrics.is_serving.set(1)
        await server.serve_until_signal(on_stop=drain)
        return 0 if engine.is_healthy else ENGINE_CORE_DIED_EXIT_STATUS
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


def _can_listen(host: str, port: int) -> bool:
    try:
        return is_port_free(host, port)
    except OSError:  # a host name that does not resolve: the server could not listen there
        return False


def _record(engine: VllmEngine, server: GrpcServer, settings: EngineSettings) -> EngineRecord:
    assert engine.info is not None
    loads = engine.loads()
    return EngineRecord(address=settings.advertise_address or f"{settings.host}:{server.port}",
                        model=engine.info.served_model_name,
                        max_model_len=engine.info.max_model_len, ttl_s=settings.registry_ttl_s,
                        num_running=loads.num_running, num_waiting=loads.num_waiting,
                        kv_cache_usage=loads.kv_cache_usage)


async def _stop_when_engine_core_dies(engine: VllmEngine, server: GrpcServer,
                                     metrics: EngineMetrics,
                                     registration: EngineRegistration | None) -> None:
    """Once vLLM's engine core has died, health turns NOT_SERVING and the engine leaves the
    registry (gateways route away; its calls have ended with UNAVAILABLE, which they retry
    elsewhere), then the service stops, as vLLM's own server does: it could serve nothing again,
    and a process left up hid the loss from `backport up` and from container restarts. A drain
    under way is cut short."""
    while engine.is_healthy:
        await asyncio.sleep(HEALTH_POLL_S)
    logger.error("vLLM's engine core died; the engine service stops")
    metrics.is_serving.set(0)
    await server.set_serving(False)
    if registration is not None:
        await registration.deregister()
    await asyncio.sleep(ENGINE_CORE_DEATH_NOTICE_S)
    server.request_stop()
