"""Server-sent events in the shape OpenAI clients read."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from services.gateway.errors import GatewayError, error_body
from services.gateway.generation import UsageCounts

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


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
