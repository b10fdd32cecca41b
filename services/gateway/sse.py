"""Server-sent events in the shape OpenAI clients read."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.errors import GatewayError, error_body
from services.gateway.generation import UsageCounts

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """A stream of server-sent events whose generator is closed as soon as the response ends,
    the client's leaving included.

    Starlette stops iterating a stream whose client went, but leaves its generator to garbage
    collection, which a reference cycle can put off for seconds; the generator's `finally` is
    what aborts the engine requests behind the stream.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def sse_stream(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """Ends every stream with `[DONE]`; a failure mid-stream becomes an error event first.

    `events` is closed as soon as the stream ends or the client goes, not when it is collected:
    closing it is what cancels the engine requests behind it.
    """
    async with aclosing(events):
        try:
            async for event in events:
                yield event
        except GatewayError as error:
            yield sse_event(error.body())
        except Exception:
            logger.exception("stream failed")
            yield sse_event(error_body("internal error while streaming", "internal_error"))
        yield DONE


def usage_dict(usage: UsageCounts) -> dict[str, Any]:
    counts = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
              "total_tokens": usage.prompt_tokens + usage.completion_tokens,
              "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if usage.reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return counts
