"""Assembles the gateway's FastAPI app: routers, admission, metrics and the backend's lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware

from services.gateway.admission import ENGINE_HEADER, AdmissionMiddleware, Traffic
from services.gateway.auth import ApiKeys
from services.gateway.backend import GatewayBackend
from services.gateway.errors import UnexpectedErrorMiddleware, install_error_handlers
from services.gateway.metrics import METRICS_CONTENT_TYPE, GatewayMetrics
from services.gateway.request_id import REQUEST_ID_HEADER, RequestIdMiddleware
from services.gateway.routes import chat, completions, conversations, models, responses, tokenize
from services.gateway.settings import GatewaySettings

# Headers the gateway answers with that a page's script may read: a browser hides every header
# not CORS-safelisted unless exposed. Which engine served (`--expose-engine-header`), a 401's
# challenge, and the request's id.
CORS_EXPOSED_HEADERS = (ENGINE_HEADER.decode(), "WWW-Authenticate", REQUEST_ID_HEADER.decode())


def create_app(settings: GatewaySettings) -> FastAPI:
    metrics = GatewayMetrics(watches_registry=settings.redis_url is not None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend = GatewayBackend(settings, metrics)
        app.state.backend = backend
        await backend.connect()
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="vLLM Backport gateway", lifespan=lifespan)
    app.state.draining = False
    app.state.traffic = Traffic()
    app.add_middleware(AdmissionMiddleware,
                       api_keys=ApiKeys.load(settings.api_key, settings.api_keys_file),
                       traffic=app.state.traffic, metrics=metrics,
                       expose_engine_header=settings.expose_engine_header)
    # Outside admission, so that it counts the 500, and inside CORS, so that a page reads it.
    app.add_middleware(UnexpectedErrorMiddleware)
    # Outside both, so that refusals and 500s carry it too.
    app.add_middleware(RequestIdMiddleware)
    if settings.allowed_origin:
        # Added last, so outermost: a preflight carries no API key and must not meet the check,
        # and a refusal must carry the CORS headers for the page to read its error.
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origin,
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=CORS_EXPOSED_HEADERS)
    install_error_handlers(app)
    for router in (models.router, chat.router, completions.router, responses.router,
                   conversations.router, tokenize.router):
        app.include_router(router)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        backend: GatewayBackend = request.app.state.backend
        return Response(metrics.render(backend.pool.engines.values()),
                        media_type=METRICS_CONTENT_TYPE)

    return app
