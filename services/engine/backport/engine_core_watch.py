"""Stops vLLM's engine core once the engine service that started it is gone.

vLLM's workers watch the engine core through a pipe, but nothing in vLLM watches the process
above the engine core: an engine service killed outright (kill -9, the OOM killer) left its
engine core and workers running, holding the model's memory and a core each.
"""

from __future__ import annotations

import os
import signal
import threading
import time

# Set by the engine service for the processes vLLM starts; only its direct child, the engine
# core, watches it (the workers below have vLLM's own pipe to the engine core).
SERVICE_PID_ENV = "BACKPORT_ENGINE_SERVICE_PID"
POLL_S = 0.5


def watch_engine_service() -> None:
    """In the engine core: SIGTERM itself, which vLLM handles as a shutdown, once its parent
    is gone. A no-op in every other process."""
    value = os.environ.get(SERVICE_PID_ENV)
    if not value or os.getppid() != int(value):
        return
    threading.Thread(target=_stop_when_orphaned, args=(int(value),), daemon=True,
                     name="backport-engine-service-watch").start()


def _stop_when_orphaned(service_pid: int) -> None:
    # A parent's death is seen as a new parent (init or a subreaper): polling getppid needs no
    # file descriptor handed through vLLM's spawn.
    while os.getppid() == service_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
