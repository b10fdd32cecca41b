"""Entry point of the gateway: uvicorn serving the app until SIGTERM, streams drained."""

from __future__ import annotations

import uvicorn

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings


def serve(settings: GatewaySettings) -> None:
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            timeout_graceful_shutdown=int(settings.drain_timeout_s),
                            log_level="info", access_log=False)
    uvicorn.Server(config).run()
