"""Entry point of the gateway: uvicorn until SIGTERM, then a drain before it stops.

On SIGTERM (or Ctrl-C) the gateway keeps listening but answers new API requests 503 and
`/health` 503, lets open requests and background responses finish (at most `drain_timeout_s`),
then exits. A second signal stops at once. A signal while the gateway still waits for the mesh
to answer stops it at once too: there is nothing to drain yet.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from services.gateway.admission import Traffic
from services.gateway.app import create_app
from services.gateway.backend import GatewayBackend
from services.gateway.settings import GatewaySettings
from services.mesh.errors import ServiceStartError
from services.mesh.ports import is_port_free

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.traffic: Traffic = app.state.traffic
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None:
            super().handle_exit(sig, frame)
            return
        if self._drain is not None:
            # uvicorn forces only a second SIGINT; its graceful shutdown would wait for the
            # open streams again, up to the drain timeout.
            self.force_exit = True
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        self.traffic.is_draining = True
        self.app.state.draining = True  # `/health` answers 503 from now on
        if not self.started:
            await self._stop_startup()
        logger.info("draining %d open request(s), %d background response(s)",
                    self.traffic.num_in_flight, self._num_background_responses())
        deadline = time.monotonic() + self.drain_timeout_s
        while ((self.traffic.num_in_flight or self._num_background_responses())
               and time.monotonic() < deadline):
            await asyncio.sleep(DRAIN_POLL_S)
        logger.info("drained; stopping")
        # uvicorn's graceful shutdown would wait for what is still open as long again: it gets
        # what is left of the drain (a second when the drain ran out), then cancels it.
        self.config.timeout_graceful_shutdown = max(1, math.ceil(deadline - time.monotonic()))
        self.should_exit = True

    def _num_background_responses(self) -> int:
        backend: GatewayBackend | None = getattr(self.app.state, "backend", None)
        return backend.background_responses.num_running if backend is not None else 0

    async def _stop_startup(self) -> None:
        """Stops the lifespan's wait for the mesh: uvicorn looks at `should_exit` only once
        the app has started, and the backend waits minutes for engines that are loading.
        Nothing is open yet to drain; the app then starts and stops at once."""
        while not self.started:
            backend: GatewayBackend | None = getattr(self.app.state, "backend", None)
            if backend is not None:  # set by the lifespan before it waits
                backend.stop_connecting()
                return
            await asyncio.sleep(DRAIN_POLL_S)


def serve(settings: GatewaySettings) -> None:
    # uvicorn binds only once the lifespan has found the mesh, minutes later while engines load:
    # a taken port would show only then, or never while an engine stays away.
    if not is_port_free(settings.host, settings.port):
        raise ServiceStartError(f"gateway cannot listen on {settings.host}:{settings.port}: the "
                                "port is already in use, or the host is not this machine's")
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            timeout_graceful_shutdown=int(settings.drain_timeout_s),
                            log_level="info", access_log=False)
    DrainingServer(config, app, settings.drain_timeout_s).run()
