"""`X-Request-Id` on every answer, as OpenAI's API sends it (the SDK's `request_id`): the
client's own where it sent a usable one (vLLM's `--enable-request-id-headers` echoes it too),
else a new `req_<hex>`."""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
# Visible ASCII, as long as a log line should carry: anything else is not echoed.
_USABLE_ID = re.compile(rb"[\x21-\x7e]{1,256}")


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == REQUEST_ID_HEADER), None)
        request_id = (given if given is not None and _USABLE_ID.fullmatch(given)
                      else f"req_{uuid.uuid4().hex}".encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER, request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)
