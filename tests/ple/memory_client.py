"""An engine stand-in for the memory test: attaches, reads every row once, then waits.

Run as `python -m tests.ple.memory_client ADDRESS`; prints `ready` when every page of
the table has been read, and exits when its stdin closes."""

from __future__ import annotations

import sys

import numpy as np

from services.ple_offload.client import PleTableClient

_CHUNK_ROWS = 1 << 19


def main() -> None:
    client = PleTableClient(sys.argv[1])
    if not client.is_local:
        raise SystemExit("expected to attach through shared memory")
    checksum = 0
    for start in range(0, client.num_rows, _CHUNK_ROWS):
        ids = np.arange(start, min(start + _CHUNK_ROWS, client.num_rows))
        checksum += int(client.gather(ids)[:, :8].sum())
    print("ready", checksum, flush=True)
    sys.stdin.read()
    client.close()


if __name__ == "__main__":
    main()
