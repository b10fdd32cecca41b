"""An error no handler knows, raised by a route: the gateway's real app, with one fake failing
route added (no real request path fails this way on purpose), over ASGI without the mesh."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

PAGE_ORIGIN = "https://chat.example"


def app_with_a_fake_failing_route() -> FastAPI:
    app = create_app(GatewaySettings(allowed_origin=[PAGE_ORIGIN]))

    @app.get("/v1/fake-failure")
    async def fake_failure() -> None:
        raise RuntimeError("a defect in a route")

    return app


def test_an_unexpected_error_is_an_openai_500_a_page_can_read() -> None:
    """Starlette answers its `Exception` handler from outside CORS, so a page saw a network
    error instead of the 500, and it re-raised the error into the server (`raise_app_exceptions`
    makes httpx raise it here, as uvicorn would close the connection)."""
    async def fetch() -> httpx.Response:
        transport = httpx.ASGITransport(app=app_with_a_fake_failing_route())
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.get("/v1/fake-failure", headers={"Origin": PAGE_ORIGIN})

    reply = asyncio.run(fetch())
    assert reply.status_code == 500
    assert reply.json() == {"error": {"message": "internal server error", "type": "internal_error",
                                      "param": None, "code": None}}
    assert reply.headers["access-control-allow-origin"] == PAGE_ORIGIN
