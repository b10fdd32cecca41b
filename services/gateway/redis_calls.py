"""Calls to the Redis that holds the state the gateway's replicas share.

A call Redis did not answer is a 503 naming the store, for the client to try again. Calls a
background response makes on its own, with no client to try again, are made again through a blip
(`redis_call_retried`); each must be one that may land twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import RedisError

from services.gateway.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_PAUSE_S = 0.2


async def redis_call(pending: Awaitable[T], store: str) -> T:
    try:
        return await pending
    except RedisError as error:
        raise ServiceUnavailableError(f"the {store} (Redis) is unavailable: {error}") from None


async def redis_call_retried(call: Callable[[], Awaitable[T]], store: str, *, retry_s: float) -> T:
    """`call()`, made again every RETRY_PAUSE_S for `retry_s` while Redis does not answer it."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return await call()
        except RedisError as error:
            if time.monotonic() + RETRY_PAUSE_S >= deadline:
                raise ServiceUnavailableError(f"the {store} (Redis) is unavailable: {error}") from None
            logger.info("%s call failed (%s); trying again", store, error)
            await asyncio.sleep(RETRY_PAUSE_S)
