"""Stock `lmcache server` (LMCache 0.5.6), with its shm-mode mappings released when an engine goes.

In the `shm` transfer mode the server maps each engine's KV segment through
`CpuShmTensorWrapper.to_tensor`, which pins the mapping in `_CPU_SHM_KEEP_ALIVE` under the
id of the very storage the pin keeps alive: the finalizer that would `munmap` it can never
run, so the server holds every engine's whole KV cache (1 GiB each in the tests) until the
server itself exits, however the engine left (unregistered or reaped). Before LMCache
releases an engine's context, the pins of that context's tensors are dropped, so releasing
the context unmaps them. Everything else is LMCache's own code, run as `lmcache.cli.main`.
The server also stops once the runner that started it is gone (`stop_with_runner`).

It imports nothing else of the project: `--lmcache-python` may run it in an environment that
has LMCache alone.
"""

from __future__ import annotations

import os
import signal
import threading

from lmcache.cli.main import main
from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
    ContextEntry,
    LMCacheDrivenTransferModule,
)
from lmcache.v1.platform.devices.cpu import shm

# The read end of a pipe whose write end only the runner (`services.kvcache.runner`) holds.
RUNNER_LIFELINE_FD_ENV = "BACKPORT_KVCACHE_RUNNER_LIFELINE_FD"

_lmcache_release_entries = LMCacheDrivenTransferModule._release_entries


def _unpin_mappings(entries: list[ContextEntry]) -> None:
    # A function of its own: no loop variable outlives it to hold a tensor, and with it the mapping.
    for entry in entries:
        for tensor in getattr(entry.cache_context, "kv_caches_", ()):
            shm._CPU_SHM_KEEP_ALIVE.pop(id(tensor.untyped_storage()), None)


def _release_entries_and_mappings(self: LMCacheDrivenTransferModule,
                                  entries: list[ContextEntry]) -> None:
    _unpin_mappings(entries)
    _lmcache_release_entries(self, entries)


LMCacheDrivenTransferModule._release_entries = _release_entries_and_mappings  # type: ignore[method-assign]


def stop_with_runner() -> None:
    """SIGTERM to this server once the runner's lifeline reads end-of-file, however the runner
    went: the server leads a session of its own, so nothing else stops it when the runner is
    killed outright, and it would hold its ports and its L1 memory."""
    fd_text = os.environ.pop(RUNNER_LIFELINE_FD_ENV, None)
    if fd_text is None:
        return
    lifeline = int(fd_text)

    def stop_at_end_of_file() -> None:
        while os.read(lifeline, 1):  # nothing is ever written: only end-of-file comes
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_at_end_of_file, name="runner-lifeline", daemon=True).start()


if __name__ == "__main__":
    stop_with_runner()
    main()
