"""Texts kept in this process for a while and within a size: the in-memory stores' records."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class ExpiringTexts:
    """Texts by key, each kept `ttl_s` from when it was last put; the oldest go first once more
    than `max_count` of them, or `max_chars` characters, are held."""

    def __init__(self, *, ttl_s: float, max_count: int, max_chars: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_count <= 0 or max_chars <= 0:
            raise ValueError("ttl_s, max_count and max_chars must be positive")
        self._ttl_s = ttl_s
        self._max_count = max_count
        self._max_chars = max_chars
        self._clock = clock
        self._texts: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._num_chars = 0

    def put(self, key: str, text: str) -> None:
        self._drop(key)
        self._texts[key] = (text, self._clock() + self._ttl_s)
        self._num_chars += len(text)
        while len(self._texts) > self._max_count or self._num_chars > self._max_chars:
            self._drop(next(iter(self._texts)))

    def get(self, key: str) -> str | None:
        held = self._texts.get(key)
        return held[0] if held is not None and held[1] > self._clock() else None

    def pop(self, key: str) -> str | None:
        """Drops the text; it, where it was still kept (one past its TTL is gone, as `get` says,
        though not yet dropped)."""
        text = self.get(key)
        self._drop(key)
        return text

    def clear(self) -> None:
        self._texts.clear()
        self._num_chars = 0

    def _drop(self, key: str) -> None:
        held = self._texts.pop(key, None)
        if held is not None:
            self._num_chars -= len(held[0])
