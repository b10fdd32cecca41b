"""Responses generated after their request was answered (Responses API, `background: true`).

Each runs as a task of the gateway that took its request, to its end, whatever became of the
client. It stops early when it is cancelled or deleted: on this replica at once, on another
through the response store (`request_stop`), which its task looks at every `stop_poll_s`. A
gateway that stops waits for them as for open requests (its drain), then stops those left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal

from services.gateway.errors import GatewayError
from services.gateway.response_store import ResponseStore, StopReason

logger = logging.getLogger(__name__)

STOP_POLL_S = 1.0
# How long a stopping gateway gives its background responses to write how they ended.
CLOSE_TIMEOUT_S = 5.0

# How a background response ended early: what its `stopped` callback writes.
EarlyEnd = Literal["cancelled", "deleted", "gateway_stopped"]


class BackgroundResponses:
    def __init__(self, store: ResponseStore, *, stop_poll_s: float = STOP_POLL_S) -> None:
        self._store = store
        self._stop_poll_s = stop_poll_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._early_ends: dict[str, EarlyEnd] = {}

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    def start(self, response_id: str, generate: Coroutine[Any, Any, None],
              stopped: Callable[[EarlyEnd], Awaitable[None]]) -> None:
        """Runs `generate`, which stores the response as it goes and as it ends; `stopped`
        stores it as it ended when it was stopped before that."""
        task = asyncio.create_task(self._run(response_id, generate, stopped),
                                   name=f"background response {response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._forget(response_id))

    async def stop(self, response_id: str, reason: StopReason) -> None:
        """Stops the response wherever it runs: here at once, elsewhere within `stop_poll_s`."""
        await self._store.request_stop(response_id, reason)
        self._stop_here(response_id, reason)

    async def aclose(self) -> None:
        for response_id in list(self._tasks):
            self._stop_here(response_id, "gateway_stopped")
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=CLOSE_TIMEOUT_S)

    def _forget(self, response_id: str) -> None:
        self._tasks.pop(response_id, None)
        self._early_ends.pop(response_id, None)

    def _stop_here(self, response_id: str, end: EarlyEnd) -> None:
        task = self._tasks.get(response_id)
        if task is not None and response_id not in self._early_ends:
            self._early_ends[response_id] = end
            task.cancel()

    async def _run(self, response_id: str, generate: Coroutine[Any, Any, None],
                   stopped: Callable[[EarlyEnd], Awaitable[None]]) -> None:
        work = asyncio.ensure_future(generate)
        end: EarlyEnd | None = None
        try:
            while end is None and not work.done():
                await asyncio.wait({work}, timeout=self._stop_poll_s)
                if not work.done():
                    end = await self._stop_requested(response_id)
        except asyncio.CancelledError:
            end = self._early_ends.get(response_id, "gateway_stopped")
        if end is None:
            try:
                work.result()
            except Exception:
                logger.exception("background response %s failed", response_id)
            return
        # Written once the generation is gone, so that nothing it was storing lands after.
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        try:
            await stopped(end)
        except GatewayError as error:
            logger.warning("background response %s ended (%s) unrecorded: %s", response_id, end,
                           error.message)

    async def _stop_requested(self, response_id: str) -> StopReason | None:
        try:
            return await self._store.stop_requested(response_id)
        except GatewayError as error:
            # The store comes back or the generation ends; the answer is stored either way.
            logger.warning("background response %s: stop not checked: %s", response_id, error.message)
            return None
