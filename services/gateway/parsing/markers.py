"""Split-safe search for markup markers in streamed text.

Text arrives in arbitrary pieces, so a marker may be cut between two deltas. `MarkerSet.find`
reports either the first complete marker or the position from which the rest of the text could
still grow into one; the caller holds that tail back until more text (or the end) arrives.
Because the answer only depends on text that can no longer change, the parse is the same for
every way of splitting the output.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MarkerMatch:
    """`marker` found at `start`; `marker is None` means `text[start:]` may still become one."""

    start: int
    marker: str | None


class MarkerSet:
    """A fixed set of markers, compiled once for repeated searches."""

    def __init__(self, markers: Iterable[str]) -> None:
        self.markers = frozenset(marker for marker in markers if marker)
        by_length = sorted(self.markers, key=len, reverse=True)
        # Longest first, so where two markers start at one place the longer one is taken.
        self._pattern = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self._proper_prefixes = frozenset(
            marker[:length] for marker in self.markers for length in range(1, len(marker))
        )
        self._max_prefix_length = max(map(len, self.markers), default=1) - 1
        self._first_chars = frozenset(marker[0] for marker in self.markers)

    def find(self, text: str, start: int = 0) -> MarkerMatch | None:
        """First marker in `text[start:]`, or where a tail that may still grow into one begins.

        A complete marker that a longer one could still extend is not reported yet: the tail is
        held back instead, so the choice never depends on where the text was split.
        """
        if self._pattern is None:
            return None
        found = self._pattern.search(text, start)
        growing_start = self._growing_tail_start(text, start)
        if growing_start is not None and (found is None or growing_start <= found.start()):
            return MarkerMatch(growing_start, None)
        if found is None:
            return None
        return MarkerMatch(found.start(), found.group())

    def _growing_tail_start(self, text: str, start: int) -> int | None:
        for position in range(max(start, len(text) - self._max_prefix_length), len(text)):
            if text[position] in self._first_chars and text[position:] in self._proper_prefixes:
                return position
        return None
