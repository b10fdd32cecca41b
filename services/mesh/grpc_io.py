"""Which threads do a service's socket I/O in grpc core. Imports no grpc: it must run before
grpc does, since grpc core reads its experiments once, when `grpc` is imported.

Every `backport` command asks for it, so the whole mesh runs one way: the gateway's calls to
the tokenizer and engines, the services' servers, and the PLE client inside vLLM's processes
(they inherit the variable; forked, they inherit grpc as the engine service set it up).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

GRPC_EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"

# grpcio 1.85's names (the version pyproject pins). With these off, grpc core reads and
# writes the sockets on the threads that poll its completion queues (iomgr) instead of
# handing every read and write to an EventEngine thread and back. That removes three of
# seven thread wake-ups per message on a server, and five or six of fourteen on a client.
# On a host whose idle CPUs halt (a VM guest without a cpuidle driver) a wake-up costs tens
# of microseconds: there a PLE LookupStream went from 0.61 / 0.98 ms (p50 / p99) to 0.50 /
# 0.86 ms with the service set so, and to 0.32 / 0.67 ms with the client's process set the
# same way (docs/ple.md, "grpcio's floor"). A grpcio that no longer knows a name logs
# "Unknown experiment" at start and ignores it.
POLLING_THREAD_IO = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


def prefer_polling_thread_io(environ: MutableMapping[str, str] = os.environ) -> None:
    """Asks grpc core for I/O on its polling threads, unless the operator set
    GRPC_EXPERIMENTS (any value, e.g. `event_engine_client` keeps grpcio's default I/O).
    Changes nothing in a process that has imported grpc already (`cli.main` called from a
    test): grpc would not read it. tests/ple/test_grpc_io.py and tests/test_mesh_grpc_io.py
    check the entry points."""
    if "grpc" not in sys.modules:
        environ.setdefault(GRPC_EXPERIMENTS_ENV, POLLING_THREAD_IO)
