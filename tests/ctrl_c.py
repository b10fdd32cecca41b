"""Ctrl-C as a terminal delivers it, for the children a test starts."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def children_take_ctrl_c() -> Iterator[None]:
    """Children started inside get SIGINT's default action, as a terminal's foreground job.

    A non-interactive shell starts its background jobs (`make test &`, nohup, some CI
    runners) with SIGINT ignored, and an ignored signal stays ignored through exec: a child
    Python then installs no KeyboardInterrupt handler and Ctrl-C reaches nothing. A handled
    signal is reset to its default by exec, so the parent handles it meanwhile.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
