"""Stop strings applied to detokenized text as it streams."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopCheck:
    text: str
    stopped: bool
    # Where the stop string ends in the text just fed, which it always reaches into; 0 unless
    # stopped. Tokens of that text past this point were generated after the stop.
    stop_end: int = 0


class StopStringMatcher:
    """Releases text only when no stop string can still begin inside it.

    The last `longest stop - 1` characters stay held back until more text shows
    whether they start a stop string; `flush` releases them at the end.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> StopCheck:
        if self.stopped:
            return StopCheck("", True)
        self._pending += text
        if not self._stops:
            released, self._pending = self._pending, ""
            return StopCheck(released, False)
        found = [(i, len(s)) for i, s in ((self._pending.find(s), s) for s in self._stops) if i >= 0]
        if found:
            cut, stop_length = min(found)
            self.stopped = True
            num_held = len(self._pending) - len(text)
            released, self._pending = self._pending[:cut], ""
            return StopCheck(released, True, stop_end=cut + stop_length - num_held)
        keep = min(self._hold, len(self._pending))
        released = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return StopCheck(released, False)

    def flush(self) -> str:
        released, self._pending = ("" if self.stopped else self._pending), ""
        return released
