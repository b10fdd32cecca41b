"""Stock `lmcache server` (LMCache 0.5.6), with its shm-mode mappings released when an engine goes.

In the `shm` transfer mode the server maps each engine's KV segment through
`CpuShmTensorWrapper.to_tensor`, which pins the mapping in `_CPU_SHM_KEEP_ALIVE` under the
id of the very storage the pin keeps alive: the finalizer that would `munmap` it can never
run, so the server holds every engine's whole KV cache (1 GiB each in the tests) until the
server itself exits, however the engine left (unregistered or reaped). Before LMCache
releases an engine's context, the pins of that context's tensors are dropped, so releasing
the context unmaps them. Everything else is LMCache's own code, run as `lmcache.cli.main`.
The server also stops once the runner that started it is gone (`services.mesh.lifeline`).

Of the project it imports only what needs the standard library alone: `--lmcache-python`
may run it in an environment that has LMCache alone.
"""

from __future__ import annotations

from lmcache.cli.main import main
from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
    ContextEntry,
    LMCacheDrivenTransferModule,
)
from lmcache.v1.platform.devices.cpu import shm

from services.kvcache import RUNNER_LIFELINE_FD_ENV
from services.mesh.lifeline import stop_when_parent_is_gone

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


if __name__ == "__main__":
    # The server leads a session of its own: nothing else stops it when the runner is killed
    # outright, and it would hold its ports and its L1 memory.
    stop_when_parent_is_gone(RUNNER_LIFELINE_FD_ENV, "the KV runner")
    main()
