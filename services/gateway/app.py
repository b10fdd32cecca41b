"""Assembles the gateway's FastAPI app: routers, error handlers and the backend's lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.gateway.backend import GatewayBackend
from services.gateway.errors import install_error_handlers
from services.gateway.routes import chat, completions, models
from services.gateway.settings import GatewaySettings


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend = GatewayBackend(settings)
        app.state.backend = backend
        await backend.connect()
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="vLLM Backport gateway", lifespan=lifespan)
    app.state.draining = False
    install_error_handlers(app)
    for router in (models.router, chat.router, completions.router):
        app.include_router(router)
    return app
