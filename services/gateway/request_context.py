"""What the gateway knows about the HTTP request being served, for code far from the route."""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RequestContext:
    started_at: float = field(default_factory=time.monotonic)
    session_id: str | None = None  # the X-Session-Id header
    # Engines that took this request's generations, in order (filled by the dispatcher).
    engine_addresses: list[str] = field(default_factory=list)


_current: ContextVar[RequestContext | None] = ContextVar("backport_request", default=None)


def set_request_context(context: RequestContext) -> None:
    _current.set(context)


def current_request_context() -> RequestContext:
    return _current.get() or RequestContext()
