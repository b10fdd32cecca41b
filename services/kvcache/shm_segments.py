"""LMCache's POSIX shared-memory segments: what they hold, and reclaiming an exited engine's.

In the shared-memory transfer mode each engine worker moves its KV cache into
`/dev/shm/lmcache_kv_<pid>_<n>` so the server can map it. The worker unlinks the segment
only when it exits through Python's normal shutdown; vLLM ends its engine-core process with
a signal, so the file stays, and the server keeps its mapping until it reaps the silent
worker. Unlinking the files of dead processes, plus LMCache's reaper unmapping them, gives
the memory back.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# `lmcache.v1.platform.devices.cpu.shm`: "/lmcache_kv_" + pid + "_" + counter.
ENGINE_SEGMENT_PATTERN = re.compile(r"^lmcache_kv_(?P<pid>\d+)_\d+$")
LMCACHE_SEGMENT_PREFIXES = ("lmcache_kv_", "lmcache_l1_pool_")


@dataclass(frozen=True, slots=True)
class SegmentFile:
    path: Path
    num_bytes: int
    owner_pid: int | None


def is_process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as error:
        # EPERM: the process exists but belongs to someone else.
        return error.errno == errno.EPERM
    return True


def lmcache_segment_files(shm_dir: Path = SHM_DIR) -> list[SegmentFile]:
    """LMCache's segments that still have a name under `shm_dir`."""
    found: list[SegmentFile] = []
    for path in shm_dir.iterdir() if shm_dir.is_dir() else ():
        if not path.name.startswith(LMCACHE_SEGMENT_PREFIXES):
            continue
        try:
            num_bytes = path.stat().st_size
        except FileNotFoundError:
            continue
        match = ENGINE_SEGMENT_PATTERN.match(path.name)
        found.append(SegmentFile(path, num_bytes, int(match["pid"]) if match else None))
    return found


def reclaim_exited_engine_segments(shm_dir: Path = SHM_DIR) -> int:
    """Unlinks engine segments whose creating process is gone; returns the bytes unlinked.

    A mapping that LMCache's server still holds keeps the pages until the server
    reaps that worker; the name is removed now so nothing else can keep them.
    """
    num_bytes = 0
    for segment in lmcache_segment_files(shm_dir):
        if segment.owner_pid is None or is_process_alive(segment.owner_pid):
            continue
        try:
            segment.path.unlink()
        except FileNotFoundError:
            continue
        logger.info("unlinked %s (%d MiB) left by exited engine process %d",
                    segment.path.name, segment.num_bytes >> 20, segment.owner_pid)
        num_bytes += segment.num_bytes
    return num_bytes


def mapped_shm_bytes(pid: int) -> int:
    """Bytes of /dev/shm files (named or already unlinked) that process `pid` maps.

    Each file counts once, at the largest extent mapped: the pages stay allocated for as
    long as any mapping of them exists, whatever `/dev/shm` lists.
    """
    extents: dict[str, int] = {}
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(str(SHM_DIR) + "/"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        offset, inode = int(fields[2], 16), fields[4]
        extents[inode] = max(extents.get(inode, 0), offset + end - start)
    return sum(extents.values())
