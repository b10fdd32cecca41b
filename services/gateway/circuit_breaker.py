"""Ejects an engine that keeps failing requests, and lets a health probe bring it back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class BreakerState(enum.Enum):
    CLOSED = "closed"  # requests flow
    OPEN = "open"      # ejected: no requests until a probe after `open_s` finds it serving


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int = 3
    open_s: float = 5.0
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    opened_at: float = field(default=0.0)

    @property
    def is_open(self) -> bool:
        return self.state is BreakerState.OPEN

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, now: float | None = None) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.failure_threshold and not self.is_open:
            self.state = BreakerState.OPEN
            self.opened_at = time.monotonic() if now is None else now

    def is_due_for_probe(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.is_open and now - self.opened_at >= self.open_s

    def record_probe(self, is_serving: bool, now: float | None = None) -> None:
        """A health probe's answer: serving closes the breaker, anything else keeps it open."""
        if is_serving:
            self.state, self.consecutive_failures = BreakerState.CLOSED, 0
        else:
            self.opened_at = time.monotonic() if now is None else now
