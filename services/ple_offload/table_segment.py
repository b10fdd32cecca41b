"""The service's side of the shared-memory table: create, fill from disk, publish, remove."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from services.ple_offload.errors import SegmentInUseError, TableFileError
from services.ple_offload.segment_layout import (
    DATA_OFFSET_BYTES,
    SHM_DIR,
    SegmentHeader,
    SegmentState,
    advise_huge_pages,
    huge_page_bytes,
    read_state,
    segment_path,
    write_state,
)
from services.ple_offload.table_format import TableSource

logger = logging.getLogger(__name__)

_COPY_CHUNK_BYTES = 64 * 1024 * 1024
# How long `create` waits for engines to let go of an earlier table's memory.
_ROOM_WAIT_S = 10.0
_ROOM_POLL_S = 0.1

ProgressCallback = Callable[[int], None]


class TableSegment:
    """Owns one named segment. Rows are written once, then only read."""

    def __init__(self, shm_name: str, source: TableSource, shm_dir: Path = SHM_DIR) -> None:
        self.shm_name = shm_name
        self.shm_dir = shm_dir
        self.source = source
        self.path = segment_path(shm_name, shm_dir)
        self.header = SegmentHeader(SegmentState.LOADING, secrets.randbits(63), source.num_rows,
                                    source.row_width, source.row_bytes, source.dtype,
                                    source.scale, source.header_sha256)
        self._mmap: mmap.mmap | None = None
        # Held open with an exclusive flock for the segment's life: a second service with
        # the same name sees the lock and leaves the segment alone (`_retire_stale_segment`).
        self._owner_fd: int | None = None
        self.rows: np.ndarray | None = None  # (num_rows, row_bytes) uint8 view of the segment

    @property
    def generation(self) -> int:
        return self.header.generation

    def create(self) -> None:
        """Creates the segment and reserves its memory, replacing a stale one by that name."""
        _retire_stale_segment(self.path)
        size = self.header.segment_bytes
        _wait_for_room(self.path.parent, size)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Reserving now turns "out of shared memory" into an error here instead of a
            # SIGBUS in the middle of the copy.
            os.posix_fallocate(fd, 0, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            advise_huge_pages(self._mmap)
        except BaseException:
            os.unlink(self.path)
            os.close(fd)
            raise
        self._owner_fd = fd
        self._mmap[:DATA_OFFSET_BYTES] = self.header.pack().ljust(DATA_OFFSET_BYTES, b"\0")
        self.rows = np.frombuffer(self._mmap, np.uint8, self.source.table_bytes,
                                  DATA_OFFSET_BYTES).reshape(self.source.num_rows,
                                                             self.source.row_bytes)

    def load(self, on_progress: ProgressCallback, stop: threading.Event) -> None:
        """Streams the rows from disk straight into the segment, dropping the page cache
        behind the copy so the machine never holds a second full copy."""
        if self._mmap is None:
            raise RuntimeError("create() the segment before loading it")
        view = memoryview(self._mmap)
        offset = DATA_OFFSET_BYTES
        try:
            for segment in self.source.segments:
                with open(segment.path, "rb", buffering=0) as f:
                    position = segment.data_start
                    while position < segment.data_end:
                        if stop.is_set():
                            raise InterruptedError("table load cancelled")
                        want = min(_COPY_CHUNK_BYTES, segment.data_end - position)
                        f.seek(position)
                        got = f.readinto(view[offset:offset + want])
                        if not got:
                            raise TableFileError(
                                f"{segment.path} is truncated: {segment.name} ends at byte "
                                f"{segment.data_end} but reading stopped at {position}")
                        os.posix_fadvise(f.fileno(), position, got, os.POSIX_FADV_DONTNEED)
                        position += got
                        offset += got
                        on_progress(got)
        finally:
            view.release()

    def publish(self) -> None:
        """Marks the rows complete; readers may attach from now on."""
        self._set_state(SegmentState.READY)
        logger.info("table %s ready in %s: %d rows x %d B (%s), generation %x",
                    self.source.tensor_name, self.path, self.source.num_rows,
                    self.source.row_bytes, self.source.dtype.name, self.generation)
        assert self.rows is not None
        huge = huge_page_bytes(self.rows.ctypes.data - DATA_OFFSET_BYTES)
        # Said at every start because it decides gather speed (see docs/ple.md, huge pages).
        logger.info("%.2f of %.2f GiB of the table sit in huge pages%s", huge / 2**30,
                    self.source.table_bytes / 2**30,
                    "" if huge else f"; mount {self.shm_dir} with huge=within_size for faster gathers")

    def is_ready(self) -> bool:
        return self._mmap is not None and self._state() is SegmentState.READY

    def close_for_readers(self) -> None:
        """Tells attached readers to reattach and removes the name; memory is freed once the
        last reader unmaps. Safe to call more than once."""
        if self._mmap is None:
            return
        if self._state() is not SegmentState.CLOSED:
            self._set_state(SegmentState.CLOSED)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def unmap(self) -> None:
        self.close_for_readers()
        self.rows = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A lookup thread outlived the grace period; the mapping goes with it.
                pass
            self._mmap = None
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    def _state(self) -> SegmentState:
        assert self._mmap is not None
        return read_state(self._mmap)

    def _set_state(self, state: SegmentState) -> None:
        assert self._mmap is not None
        write_state(self._mmap, state)


def _wait_for_room(folder: Path, size: int) -> None:
    """Returns once `folder` has `size` bytes free. A segment closed a moment ago (by the
    previous service, or retired just now) keeps its memory until the last engine unmaps
    it, which engines do within about a second (`PleTableClient`): on a tmpfs sized for one
    table, a restart waits for that instead of failing. A tmpfs too small for the table
    fails at once."""
    stats = os.statvfs(folder)
    if stats.f_blocks * stats.f_frsize < size:
        raise OSError(f"{folder} holds {stats.f_blocks * stats.f_frsize} bytes in all; the "
                      f"table needs {size} (mount it larger, e.g. docker --shm-size)")
    deadline = time.monotonic() + _ROOM_WAIT_S
    is_waiting = False
    while (free := _free_bytes(folder)) < size:
        if time.monotonic() >= deadline:
            raise OSError(f"{folder} has {free} bytes free; the table needs {size} (what else "
                          "is there, or an earlier table's segment that a process still maps)")
        if not is_waiting:
            logger.info("%s has %d bytes free, the table needs %d: waiting up to %g s for "
                        "engines to unmap an earlier table", folder, free, size, _ROOM_WAIT_S)
            is_waiting = True
        time.sleep(_ROOM_POLL_S)


def _free_bytes(folder: Path) -> int:
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def _retire_stale_segment(path: os.PathLike[str]) -> None:
    """A service killed without cleanup leaves its segment behind with readers possibly
    attached: mark it CLOSED so they reattach, then remove the name. A segment whose
    service still runs (it holds the segment's flock) is refused, not taken over."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SegmentInUseError(
                f"{path} belongs to a PLE service that is still running; stop it first, "
                f"or give this service another --shm-name") from None
        if os.fstat(fd).st_size < DATA_OFFSET_BYTES:
            raise OSError(f"{path} exists and is not a PLE table; refusing to replace it")
        with mmap.mmap(fd, DATA_OFFSET_BYTES) as page:
            try:
                SegmentHeader.unpack(page, str(path))
            except ValueError as exc:
                raise OSError(f"{path} exists and is not a PLE table; refusing to replace it") from exc
            write_state(page, SegmentState.CLOSED)
    finally:
        os.close(fd)
    os.unlink(path)
    logger.warning("removed stale segment %s left by a service that did not stop cleanly", path)
