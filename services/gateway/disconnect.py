"""Cancels a request's work when its client leaves before the response has begun.

Uvicorn never cancels an ASGI app whose client went away, and Starlette's streaming response
listens for the disconnect only once it streams. Until a response starts (a non-streamed answer
being generated whole, a prompt being rendered or waiting for its first token) nothing
listened: the engine generated the whole answer for no one. vLLM's server cancels its handlers
the same way (`with_cancellation`).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send


async def call_until_client_leaves(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> bool:
    """Runs `app` on an HTTP request. True when the client left before the response began:
    `app` was cancelled then, and nothing was sent."""
    body_received = asyncio.Event()
    has_response_started = False

    async def receive_noting_the_body_end() -> Message:
        message = await receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            body_received.set()
        return message

    async def send_noting_the_start(message: Message) -> None:
        nonlocal has_response_started
        if message["type"] == "http.response.start":
            has_response_started = True
            # A streaming response listens for the disconnect itself from here on.
            watch.cancel()
        await send(message)

    async def wait_for_disconnect() -> None:
        # Once the app has the whole body, the next message is the disconnect: reading it
        # takes nothing the app would read.
        await body_received.wait()
        while (await receive())["type"] != "http.disconnect":
            pass

    serving = asyncio.ensure_future(app(scope, receive_noting_the_body_end, send_noting_the_start))
    watch = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait((serving, watch), return_when=asyncio.FIRST_COMPLETED)
        has_client_left = watch.done() and not watch.cancelled() and not has_response_started
        if has_client_left:
            # Cancelling the route's task is what cancels its engine calls (an abort in vLLM).
            serving.cancel()
        try:
            await serving
        except asyncio.CancelledError:
            if has_client_left:
                return True
            raise
        return False
    finally:
        # Cancelled itself (a forced shutdown), asyncio.wait leaves the tasks it waits on running.
        watch.cancel()
        serving.cancel()
