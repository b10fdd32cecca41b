"""Responses generated after their request was answered (Responses API, `background: true`).

Each runs as a task of the gateway that took its request, to its end, whatever became of the
client. It stops early when it is cancelled or deleted: on this replica at once, on another
through the response store (`request_stop`), which its task looks at every `stop_poll_s` as it
renews the response's lease, and which refuses its writes from the moment the stop is asked. A
gateway that stops waits for them as for open requests (its drain), then stops those left. One
whose lease lapsed (Redis lost for longer than the lease) stops too: the store has given it up
as failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.errors import GatewayError
from services.gateway.response_store import GeneratorStop, ResponseStore, StopReason

logger = logging.getLogger(__name__)

STOP_POLL_S = 1.0
# How long a stopping gateway gives its background responses to write how they ended.
CLOSE_TIMEOUT_S = 5.0

# How a background response ended early: what its `stopped` callback writes.
EarlyEnd = StopReason | Literal["gateway_stopped"]


@dataclass(slots=True)
class _Running:
    task: asyncio.Task[None] | None = None
    # Set, with `stop_signal`, by a stop on this replica or by the gateway closing.
    early_end: EarlyEnd | None = None
    stop_signal: asyncio.Event = field(default_factory=asyncio.Event)


class BackgroundResponses:
    def __init__(self, store: ResponseStore, *, stop_poll_s: float = STOP_POLL_S) -> None:
        self._store = store
        self._stop_poll_s = stop_poll_s
        self._running: dict[str, _Running] = {}

    @property
    def num_running(self) -> int:
        return len(self._running)

    def start(self, response_id: str, generate: Coroutine[Any, Any, None],
              stopped: Callable[[EarlyEnd], Awaitable[None]]) -> None:
        """Runs `generate`, which stores the response as it goes and as it ends, its writes
        refused once a stop is requested (`unless_stopped`); `stopped` stores it as it ended
        when it was stopped before that."""
        running = _Running()
        running.task = asyncio.create_task(self._run(response_id, generate, stopped, running),
                                           name=f"background response {response_id}")
        self._running[response_id] = running
        running.task.add_done_callback(lambda _: self._running.pop(response_id, None))

    async def stop(self, response_id: str, reason: StopReason) -> None:
        """Stops the response wherever it runs: here at once, elsewhere within `stop_poll_s`."""
        await self._store.request_stop(response_id, reason)
        self._stop_here(response_id, reason)

    async def aclose(self) -> None:
        for response_id in list(self._running):
            self._stop_here(response_id, "gateway_stopped")
        tasks = [running.task for running in self._running.values() if running.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)

    def _stop_here(self, response_id: str, end: EarlyEnd) -> None:
        running = self._running.get(response_id)
        if running is not None and running.early_end is None:
            running.early_end = end
            running.stop_signal.set()

    async def _run(self, response_id: str, generate: Coroutine[Any, Any, None],
                   stopped: Callable[[EarlyEnd], Awaitable[None]], running: _Running) -> None:
        # Signalled rather than cancelled: a task cancelled before its first step would never
        # run `generate` nor record how the response ended.
        work = asyncio.ensure_future(generate)
        signalled = asyncio.ensure_future(running.stop_signal.wait())
        end: EarlyEnd | Literal["lease_lapsed"] | None = None
        try:
            while end is None and not work.done():
                await asyncio.wait({work, signalled}, timeout=self._stop_poll_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                end = running.early_end
                if end is None and not work.done():
                    end = await self._renewal(response_id)
            if end is None:
                # A stop may have come as it ended: its last writes were refused then.
                end = await self._renewal(response_id)
        finally:
            signalled.cancel()
        if end is None:
            try:
                work.result()
            except Exception:
                logger.exception("background response %s failed", response_id)
            return
        # Recorded once the generation is gone, so that nothing it was storing lands after.
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        if end == "lease_lapsed":
            # Readers take it for failed already, and the store refuses what it would write.
            logger.warning("background response %s stopped: its lease lapsed", response_id)
            return
        try:
            await stopped(end)
        except GatewayError as error:
            logger.warning("background response %s ended (%s) unrecorded: %s", response_id, end,
                           error.message)

    async def _renewal(self, response_id: str) -> GeneratorStop | None:
        try:
            return await self._store.renew_lease(response_id)
        except GatewayError as error:
            # The store comes back or the generation ends; the answer is stored either way.
            logger.warning("background response %s: lease not renewed: %s", response_id,
                           error.message)
            return None
