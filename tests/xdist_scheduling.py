"""How `make test` spreads the test files over its pytest-xdist workers."""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

# Folders whose files run one after another on one worker, never beside each other:
# tests/kvcache's count LMCache's segments in /dev/shm, which every KV service writes;
# tests/cluster's start three engines or more a module, two of which overfill CI's 24 GB.
ONE_WORKER_FOLDERS = ("tests/cluster/", "tests/kvcache/")


class FileScheduling(LoadFileScheduling):
    """A test file runs whole on one worker, so its module fixtures start once; the files of a
    ONE_WORKER_FOLDERS folder form one such unit."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return next((folder for folder in ONE_WORKER_FOLDERS if path.startswith(folder)), path)
