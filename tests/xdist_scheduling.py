"""How `make test` spreads the test files over its pytest-xdist workers."""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling

# Folders whose files run one after another on one worker, never beside each other:
# tests/kvcache's count LMCache's segments in /dev/shm, which every KV service writes;
# tests/cluster's start three engines or more a module, two of which overfill CI's 24 GB.
ONE_WORKER_FOLDERS = ("tests/cluster/", "tests/kvcache/")
# Units that take minutes, longest first (a CI run's seconds on one worker: 520, 300, 190,
# 150, 100). They go out before the rest, so that the run ends on short files: started
# last, one of them had left the other worker idle for about a minute.
LONG_UNITS = ("tests/kvcache/", "tests/cluster/", "tests/test_vllm_server_parity.py",
              "tests/e2e/test_deepseek_v4_mesh.py", "tests/test_launcher_killed.py")


class FileScheduling(LoadFileScheduling):
    """A test file runs whole on one worker, so its module fixtures start once; the files of a
    ONE_WORKER_FOLDERS folder form one such unit. LONG_UNITS are handed out first."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return next((folder for folder in ONE_WORKER_FOLDERS if path.startswith(folder)), path)

    def _assign_work_unit(self, node: Any) -> None:
        # xdist hands out the queue's first unit; in its own order that is the unit with the
        # most tests, which says little about how long a unit runs.
        waiting_long = [unit for unit in LONG_UNITS if unit in self.workqueue]
        if waiting_long:
            self.workqueue.move_to_end(waiting_long[0], last=False)
        super()._assign_work_unit(node)
