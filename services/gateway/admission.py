"""Who gets into the API: API keys (401), draining (503); counts what is inside, and cancels
what its client left before the response began.

A pure ASGI middleware, so that streamed responses count as in flight until their last byte.
`/health` and `/metrics` stay open: load balancers and scrapers carry no keys.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.auth import ApiKeys
from services.gateway.disconnect import call_until_client_leaves
from services.gateway.errors import GatewayError, ServiceUnavailableError, UnauthorizedError
from services.gateway.metrics import GatewayMetrics
from services.gateway.request_context import RequestContext, set_request_context

GUARDED_PREFIX = "/v1/"
# vLLM leaves its extension endpoints open; they cost tokenizer time, so they take a key here.
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})
ENGINE_HEADER = b"x-backport-engine"
# nginx's status for a request whose client closed the connection before the response began;
# it is only counted, never sent.
CLIENT_CLOSED_REQUEST = 499


class Traffic:
    """Requests inside the API now, and whether the gateway has begun to drain."""

    def __init__(self) -> None:
        self.num_in_flight = 0
        self.is_draining = False


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, *, api_keys: ApiKeys, traffic: Traffic,
                 metrics: GatewayMetrics, expose_engine_header: bool = False) -> None:
        self.app = app
        self.expose_engine_header = expose_engine_header
        self.api_keys = api_keys
        self.traffic = traffic
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"].startswith(GUARDED_PREFIX)
                                           or scope["path"] in GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        started_at = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        authorization = headers.get("authorization")
        if not self.api_keys.allows(authorization):
            # OpenAI's two wordings: a client with no key set is told so, not that it is wrong.
            problem = ("You didn't provide an API key." if not authorization
                       else "Incorrect API key provided.")
            await self._refuse(send, UnauthorizedError(
                f"{problem} Pass it as `Authorization: Bearer <key>`.",
                key_given=bool(authorization)))
            return
        if self.traffic.is_draining:
            # Closed: a client's pool would otherwise bring its retry back on this connection,
            # to be refused again until the drain ends, instead of to a replica that serves.
            await self._refuse(send, ServiceUnavailableError(
                "the gateway is shutting down; retry on another replica"), close_connection=True)
            return
        context = RequestContext(started_at=started_at, session_id=headers.get("x-session-id"))
        set_request_context(context)
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.expose_engine_header and context.engine_addresses:
                    message = dict(message)
                    message["headers"] = [*message.get("headers", []), (
                        ENGINE_HEADER, ",".join(context.engine_addresses).encode())]
            await send(message)

        self.traffic.num_in_flight += 1
        self.metrics.requests_in_flight.inc()
        try:
            if await call_until_client_leaves(self.app, scope, receive, send_with_status):
                status = CLIENT_CLOSED_REQUEST
        finally:
            self.traffic.num_in_flight -= 1
            self.metrics.requests_in_flight.dec()
            self.metrics.requests.labels(str(status)).inc()
            if status < 400 or status == CLIENT_CLOSED_REQUEST:
                # As vLLM's, a latency of requests served (or abandoned while they ran); an
                # error answered in a millisecond would drag every quantile down.
                self.metrics.e2e_latency.observe(time.monotonic() - started_at)

    async def _refuse(self, send: Send, error: GatewayError, *,
                      close_connection: bool = False) -> None:
        self.metrics.requests.labels(str(error.status)).inc()
        body = json.dumps(error.body()).encode()
        head: dict[str, Any] = {"type": "http.response.start", "status": error.status,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()),
                                            *((name.lower().encode(), value.encode())
                                              for name, value in error.headers.items()),
                                            *([(b"connection", b"close")] if close_connection
                                              else [])]}
        await send(head)
        await send({"type": "http.response.body", "body": body})
