"""A stream whose client leaves has its events generator closed at once, not at garbage
collection: the generator's `finally` is what aborts the engine requests behind it.

Starlette's own response, driven through ASGI the way uvicorn drives it: the client leaves after
the first event while the second is being written (its socket full), so the generator waits at a
`yield`. The test holds the generator, so only the response can have closed it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Message

from services.gateway.sse import EventStreamResponse


def closed_after_the_client_left(response_type: type[StreamingResponse]) -> bool:
    closed = asyncio.Event()

    async def events() -> AsyncGenerator[str, None]:
        try:
            while True:
                yield "data: {}\n\n"
        finally:
            closed.set()

    async def run() -> bool:
        generator = events()
        sent_body = asyncio.Event()

        async def receive() -> Message:
            await sent_body.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                if sent_body.is_set():
                    await asyncio.Event().wait()  # a write that never drains
                sent_body.set()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "method": "GET", "path": "/", "headers": []}
        if response_type is EventStreamResponse:
            response = EventStreamResponse(generator)
        else:
            response = response_type(generator, media_type="text/event-stream")
        await response(scope, receive, send)
        await asyncio.sleep(0.1)
        return closed.is_set()

    return asyncio.run(run())


def test_a_left_stream_s_generator_is_closed_by_the_response() -> None:
    assert closed_after_the_client_left(EventStreamResponse)


def test_starlette_alone_leaves_it_open() -> None:
    """Why the response above exists."""
    assert not closed_after_the_client_left(StreamingResponse)
