"""Ties vLLM's processes to the engine service that started them.

vLLM's workers watch the engine core through a pipe, but nothing in vLLM watches the process
above the engine core: an engine service killed outright (kill -9, the OOM killer) left its
engine core and workers running, holding the model's memory and a core each.

A terminal's Ctrl-C goes to its whole foreground process group, vLLM's processes included,
which stopped at once on SIGINT and failed the requests the service was draining. Below the
service they ignore it: the service's drain stops them.
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
    """In vLLM's processes below an engine service: ignore SIGINT; in the engine core, also
    SIGTERM itself, which vLLM handles as a shutdown, once its parent is gone. In the service,
    the same for an engine core it forks. A no-op in every other process."""
    value = os.environ.get(SERVICE_PID_ENV)
    if not value:
        return
    service_pid = int(value)
    if os.getpid() == service_pid:
        # A forked child loads no plugins: it inherits them, loaded, from the service.
        os.register_at_fork(before=_block_sigint_across_fork,
                            after_in_parent=_unblock_sigint_after_fork,
                            after_in_child=lambda: _start_watch(service_pid))
        return
    # vLLM sets its own SIGINT handler before it loads plugins, so this one stands.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() == service_pid:
        _start_watch(service_pid)


# In a forked child vLLM sets its SIGINT handler after the fork, over any ignore; blocked,
# SIGINT never reaches it. The block is set before the fork, because grpc's own fork handlers
# start threads in the child, which take the forking thread's mask, before Python's
# after-fork handlers run. Every thread the child starts later inherits it too.
_mask_before_fork: set[signal.Signals] = set()


def _block_sigint_across_fork() -> None:
    global _mask_before_fork
    _mask_before_fork = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _unblock_sigint_after_fork() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, _mask_before_fork)


def _start_watch(service_pid: int) -> None:
    threading.Thread(target=_stop_when_orphaned, args=(service_pid,), daemon=True,
                     name="backport-engine-service-watch").start()


def _stop_when_orphaned(service_pid: int) -> None:
    # A parent's death is seen as a new parent (init or a subreaper): polling getppid needs no
    # file descriptor handed through vLLM's spawn.
    while os.getppid() == service_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
