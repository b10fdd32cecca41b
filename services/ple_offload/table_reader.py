"""Reads rows from a table segment on this machine: a read-only mapping, no service call."""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from services.ple_offload.errors import TableClosedError, TableUnavailableError
from services.ple_offload.row_gather import as_row_ids, check_row_ids, take_checked_rows
from services.ple_offload.segment_layout import (
    DATA_OFFSET_BYTES,
    SHM_DIR,
    STATE_AND_GENERATION_BYTES,
    STATE_OFFSET,
    SegmentHeader,
    SegmentState,
    advise_huge_pages,
    huge_page_bytes,
    ready_state_and_generation,
    segment_path,
)


# Below this many rows one thread gathers: waking a pool costs more than it saves.
_PARALLEL_GATHER_MIN_ROWS = 16_384


class SharedTableReader:
    """A read-only view of one table generation. Every process maps the same pages, so
    any number of readers add no copy of the table.

    Random row gathers are bound by memory latency (a TLB miss and about three cache
    misses per row), not bandwidth, so large gathers are split over `gather_threads`
    threads (numpy releases the GIL while it copies)."""

    def __init__(self, shm_name: str, *, shm_dir: Path = SHM_DIR, gather_threads: int = 1) -> None:
        path = segment_path(shm_name, shm_dir)
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise TableUnavailableError(f"no PLE table segment {path}: is the service running "
                                        "on this machine?") from exc
        except OSError as exc:
            raise TableUnavailableError(f"cannot open PLE table segment {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < DATA_OFFSET_BYTES:
                raise TableUnavailableError(f"{path} is not a PLE table segment")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            advise_huge_pages(self._mmap)
        finally:
            os.close(fd)
        try:
            try:
                self.header = SegmentHeader.unpack(self._mmap, str(path))
            except ValueError as exc:  # another layout version, or not a PLE segment at all
                raise TableUnavailableError(str(exc)) from exc
            if self.header.state is SegmentState.LOADING:
                raise TableUnavailableError(f"PLE table {path} is still loading")
            if self.header.state is SegmentState.CLOSED:
                raise TableClosedError(f"PLE table {path} was closed by its service")
            if size < self.header.segment_bytes:
                raise TableUnavailableError(f"{path} is shorter than its header says")
        except BaseException:
            self._mmap.close()
            raise
        self._ready = ready_state_and_generation(self.header.generation)
        self._rows: np.ndarray | None = np.frombuffer(
            self._mmap, np.uint8, self.header.num_rows * self.header.row_bytes, DATA_OFFSET_BYTES,
        ).reshape(self.header.num_rows, self.header.row_bytes)
        self._gather_threads = gather_threads
        self._pool = ThreadPoolExecutor(gather_threads, "ple-gather") if gather_threads > 1 else None

    @property
    def generation(self) -> int:
        return self.header.generation

    def gather(self, row_ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows for `row_ids` (any shape of int64) as uint8 [*row_ids.shape, row_bytes].

        Raises TableClosedError once the service has stopped or restarted: the rows
        are still mapped, but the caller must reattach to reach the live table."""
        rows = self._live_rows()
        flat = np.ascontiguousarray(as_row_ids(row_ids)).reshape(-1)
        check_row_ids(flat, self.header.num_rows)
        if out is None:
            out = np.empty((flat.size, self.header.row_bytes), np.uint8)
        out_rows = out.reshape(flat.size, self.header.row_bytes)
        if self._pool is None or flat.size < _PARALLEL_GATHER_MIN_ROWS:
            take_checked_rows(rows, flat, out_rows)
        else:
            bounds = np.linspace(0, flat.size, self._gather_threads + 1, dtype=np.int64)
            parts = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
            try:
                pending = [self._pool.submit(take_checked_rows, rows, flat[p], out_rows[p])
                           for p in parts]
            except RuntimeError as exc:  # the pool was shut down: closed on another thread
                raise TableClosedError(f"PLE table {self.path} was detached; reattach") from exc
            for done in pending:
                done.result()
        return out.reshape(*np.shape(row_ids), self.header.row_bytes)

    def mapped_region(self) -> tuple[int, int]:
        """(address, bytes) of the whole read-only mapping, header page included: what
        `cuda_table.CudaHostTable` registers with the GPU driver. The rows start
        DATA_OFFSET_BYTES in."""
        rows = self._live_rows()
        return rows.ctypes.data - DATA_OFFSET_BYTES, len(self._mmap)

    def check_live(self) -> None:
        """Raises TableClosedError once the service has stopped or restarted (the same
        check `gather` makes), for readers of the rows that do not go through `gather`."""
        self._live_rows()

    def is_live(self) -> bool:
        """False once the service has stopped or restarted, or this reader was closed."""
        try:
            self._live_rows()
        except TableClosedError:
            return False
        return True

    def huge_page_bytes(self) -> int:
        """Bytes of the table this process maps with huge pages (of the pages touched so
        far): 0 means every row gather pays a 4 KiB-page TLB miss."""
        if self._rows is None:
            return 0
        return huge_page_bytes(self._rows.ctypes.data - DATA_OFFSET_BYTES)

    def table_rows(self) -> np.ndarray:
        """The whole table as a read-only uint8 [num_rows, row_bytes] array (no copy)."""
        return self._live_rows()

    def close(self) -> None:
        """Unmaps; the caller must hold no array returned by `table_rows`."""
        if self._rows is None:
            return
        self._rows = None
        if self._pool is not None:
            self._pool.shutdown()
        try:
            self._mmap.close()
        except BufferError:
            # A gather on another thread still holds the view; the mapping goes when it ends.
            pass

    def _live_rows(self) -> np.ndarray:
        # Read once: `close` on another thread may clear it. While the caller holds the
        # array, the mapping under it cannot be unmapped (mmap.close raises BufferError).
        rows = self._rows
        if rows is None:
            raise TableClosedError(f"PLE table {self.path} was detached; reattach")
        if self._mmap[STATE_OFFSET:STATE_OFFSET + STATE_AND_GENERATION_BYTES] != self._ready:
            raise TableClosedError(
                f"the PLE service closed table {self.path} (generation "
                f"{self.header.generation:x}): it stopped or restarted; reattach")
        return rows

