"""A process stops once the process that started it is gone, however it went.

The parent keeps the write end of a pipe and hands the read end to its child (named by an
environment variable); nothing is ever written, so the child reads end-of-file only when
every copy of the write end is closed, which the kernel does when the parent dies, even by
SIGKILL. The child then sends itself SIGTERM and stops as it would on a signal.

Standard library only: LMCache's server imports it from an environment that may lack the
project's dependencies.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

logger = logging.getLogger(__name__)


def stop_when_parent_is_gone(fd_env: str, parent: str) -> None:
    """Watches the lifeline named by `fd_env`, if this process was given one; `parent` names
    the process it comes from, for the log."""
    fd_text = os.environ.pop(fd_env, None)  # not for the processes this one starts
    if fd_text is None:
        return
    lifeline = int(fd_text)

    def stop_at_end_of_file() -> None:
        while os.read(lifeline, 1):  # nothing is ever written: only end-of-file comes
            pass
        logger.warning("%s is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_at_end_of_file, name="lifeline", daemon=True).start()
