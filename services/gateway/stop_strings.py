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
    # The stop string found, when stopped.
    stop: str | None = None


class StopStringMatcher:
    """Releases text only when no stop string can still begin inside it.

    The last `longest stop - 1` characters stay held back until more text shows
    whether they start a stop string; `flush` releases them at the end. With
    `include_stop` (vLLM's `include_stop_str_in_output`) nothing is held back and the
    stop string that ends the text stays in it.
    """

    def __init__(self, stops: list[str], *, include_stop: bool = False) -> None:
        self._stops = stops
        self._include_stop = include_stop
        # A stop string ending in new text can begin this far back in the text before it.
        self._num_context = max((len(s) for s in stops), default=1) - 1
        self._hold = 0 if include_stop else self._num_context
        self._context = ""  # the last `_num_context` characters fed, released or not
        self._pending = ""  # the held ones among them
        self.stopped = False

    def feed(self, text: str, *, num_protected_chars: int = 0) -> StopCheck:
        """`num_protected_chars`: how many characters at the start of `text` belong to the
        choice's first `min_tokens` tokens; as in vLLM, no stop string may end within them."""
        if self.stopped:
            return StopCheck("", True)
        if not self._stops:
            return StopCheck(text, False)
        window = self._context + text
        match = self._first_stop(window, len(self._context) + num_protected_chars)
        unreleased_from = len(self._context) - len(self._pending)
        if match is not None:
            start, stop = match
            end = start + len(stop)
            self.stopped = True
            released = window[unreleased_from:end if self._include_stop else start]
            self._pending = self._context = ""
            return StopCheck(released, True, stop_end=end - (len(window) - len(text)), stop=stop)
        self._context = window[max(0, len(window) - self._num_context):]
        unreleased = window[unreleased_from:]
        num_kept = min(self._hold, len(unreleased))
        self._pending = unreleased[len(unreleased) - num_kept:]
        return StopCheck(unreleased[:len(unreleased) - num_kept], False)

    def flush(self) -> str:
        released, self._pending = ("" if self.stopped else self._pending), ""
        return released

    def _first_stop(self, window: str, new_from: int) -> tuple[int, str] | None:
        """The stop string in `window` that ends first past `new_from` (ties: the earlier
        listed), with where it starts; as vLLM matches, the result is the same however the
        text was split into feeds."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = window.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best[0] + len(best[1])):
                best = (start, stop)
        return best
