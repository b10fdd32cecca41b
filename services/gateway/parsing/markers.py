"""Split-safe search for markup markers in streamed text.

Text arrives in arbitrary pieces, so a marker may be cut between two deltas. `find_marker`
reports either the first complete marker or the position from which the rest of the text could
still grow into one; the caller holds that tail back until more text (or the end) arrives.
Because the answer only depends on text that can no longer change, the parse is the same for
every way of splitting the output.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MarkerMatch:
    """`marker` found at `start`; `marker is None` means `text[start:]` may still become one."""

    start: int
    marker: str | None


def find_marker(text: str, markers: Collection[str]) -> MarkerMatch | None:
    """First marker in `text` (the longest when several start at one place), or None.

    A complete marker that a longer one could still extend is not reported yet: the tail is
    held back instead, so the choice never depends on where the text was split.
    """
    if not markers:
        return None
    first_chars = {marker[0] for marker in markers}
    for start, char in enumerate(text):
        if char not in first_chars:
            continue
        num_left = len(text) - start
        complete = [marker for marker in markers if text.startswith(marker, start)]
        is_growing = any(
            len(marker) > num_left and marker.startswith(text[start:]) for marker in markers
        )
        if is_growing:
            return MarkerMatch(start, None)
        if complete:
            return MarkerMatch(start, max(complete, key=len))
    return None
