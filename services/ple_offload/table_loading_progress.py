"""A progress bar for the table copy (tqdm on a terminal, periodic log lines otherwise)."""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType

from tqdm import tqdm

logger = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0


class LoadingProgress:
    def __init__(self, total_bytes: int, *, enabled: bool) -> None:
        self._total = total_bytes
        self._done = 0
        self._enabled = enabled
        self._bar: tqdm | None = None
        self._started = time.monotonic()
        self._last_log = self._started

    def __enter__(self) -> LoadingProgress:
        if self._enabled and sys.stderr.isatty():
            self._bar = tqdm(total=self._total, unit="B", unit_scale=True, unit_divisor=1024,
                             desc="loading PLE table")
        return self

    def advance(self, num_bytes: int) -> None:
        """Called from the copying thread after each chunk."""
        self._done += num_bytes
        if self._bar is not None:
            self._bar.update(num_bytes)
            return
        now = time.monotonic()
        if self._enabled and now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            logger.info("loading PLE table: %.1f%% (%.2f of %.2f GiB)", 100 * self._done / self._total,
                        self._done / 2**30, self._total / 2**30)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.close()
        if exc is None:
            seconds = time.monotonic() - self._started
            logger.info("loaded %.2f GiB in %.1f s (%.2f GiB/s)", self._done / 2**30, seconds,
                        self._done / 2**30 / max(seconds, 1e-9))
