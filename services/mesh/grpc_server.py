"""Runs a gRPC aio server with the standard health service until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.mesh.channels import GRPC_OPTIONS
from services.mesh.errors import ServiceStartError

logger = logging.getLogger(__name__)

Registrar = Callable[[grpc.aio.Server], None]

# gRPC sets SO_REUSEPORT by default, so a second server on a taken port binds too and the
# kernel splits connections between the two; without it the second one fails to start.
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0)]
CANCELLED_CALLS_END_S = 0.1


class GrpcServer:
    """Owns one aio server, its health status and its shutdown on signals."""

    def __init__(self, service_name: str, address: str, *, grace_s: float = 30.0) -> None:
        self.service_name = service_name
        self.address = address
        self.grace_s = grace_s
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self._stopping = asyncio.Event()
        self._stop_at_once = asyncio.Event()

    def add(self, registrar: Registrar) -> None:
        registrar(self.server)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", status)
        await self.health.set(self.service_name, status)

    async def start(self) -> None:
        try:
            self.port = self.server.add_insecure_port(self.address)
        except RuntimeError:
            raise self.port_taken_error() from None
        await self.server.start()
        logger.info("%s listening on %s", self.service_name, self.address)

    def port_taken_error(self) -> ServiceStartError:
        """What stops the service when it cannot listen on its address."""
        return ServiceStartError(f"{self.service_name} cannot listen on {self.address}: the port "
                                 "is already in use, or the host is not this machine's")

    async def stop_now(self) -> None:
        """Stops without a drain, cancelling calls in progress; nothing to do once stopped."""
        await self.server.stop(None)

    def request_stop(self) -> None:
        """The first request drains; another one cuts the drain short, as the gateway's second
        signal does (`backport up` passes a second Ctrl-C on to every service)."""
        if self._stopping.is_set():
            self._stop_at_once.set()
        self._stopping.set()

    def stop_on_signals(self) -> None:
        """From now on SIGTERM/SIGINT ask this server to stop (a drain once it serves; at once on
        a second signal)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def serve_until_signal(self, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serves until SIGTERM/SIGINT, then drains: NOT_SERVING, `on_stop`, graceful stop."""
        self.stop_on_signals()
        await self.set_serving(True)
        await self._stopping.wait()
        logger.info("%s stopping", self.service_name)
        await self.set_serving(False)
        if on_stop is not None:
            await on_stop()
        cut_short = asyncio.create_task(self._cut_drain_short())
        try:
            await self.server.stop(self.grace_s)
        finally:
            cut_short.cancel()
        # Calls the drain's end cancelled need a moment to end. Ended by asyncio.run's
        # teardown instead, each is cancelled again, and grpc logs it as an ERROR traceback.
        await asyncio.sleep(CANCELLED_CALLS_END_S)
        logger.info("%s stopped", self.service_name)

    async def _cut_drain_short(self) -> None:
        await self._stop_at_once.wait()
        logger.info("%s stopping at once: a second signal ended its drain", self.service_name)
        await self.stop_now()
