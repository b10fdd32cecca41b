"""The byte layout of a table's POSIX shared-memory segment, shared by service and readers.

A 4 KiB header page, then the rows, row-major, exactly as stored in the file. The
service writes `state` last when loading (LOADING -> READY) and first when stopping
(READY -> CLOSED), so a reader that checks `state` and `generation` before a gather
never mistakes a stale or half-loaded segment for the live table.
"""

from __future__ import annotations

import enum
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from services.ple_offload.table_format import RowDtype

MAGIC = b"BPPLE\x00\x00\x01"
LAYOUT_VERSION = 1
DATA_OFFSET_BYTES = 4096
SHM_DIR = Path("/dev/shm")

# magic, state, layout version, generation, rows, row width, row bytes, dtype, scale,
# header sha256, data offset
_HEADER = struct.Struct("<8sIIQQIIIf32sQ")
_STATE_AND_GENERATION = struct.Struct("<IIQ")  # state, layout version, generation at byte 8
_STATE = struct.Struct("<I")
STATE_OFFSET = 8


class SegmentState(enum.IntEnum):
    LOADING = 1
    READY = 2
    CLOSED = 3


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    state: SegmentState
    generation: int
    num_rows: int
    row_width: int
    row_bytes: int
    dtype: RowDtype
    scale: float | None
    header_sha256: bytes

    @property
    def segment_bytes(self) -> int:
        return DATA_OFFSET_BYTES + self.num_rows * self.row_bytes

    def pack(self) -> bytes:
        scale = math.nan if self.scale is None else self.scale
        return _HEADER.pack(MAGIC, self.state, LAYOUT_VERSION, self.generation, self.num_rows,
                            self.row_width, self.row_bytes, self.dtype, scale,
                            self.header_sha256, DATA_OFFSET_BYTES)

    @classmethod
    def unpack(cls, buffer: bytes | memoryview, where: str) -> SegmentHeader:
        """Parses a header; `where` names the segment in error messages."""
        (magic, state, version, generation, num_rows, row_width, row_bytes, dtype, scale,
         sha, data_offset) = _HEADER.unpack_from(buffer, 0)
        if magic != MAGIC or version != LAYOUT_VERSION or data_offset != DATA_OFFSET_BYTES:
            raise ValueError(f"{where} is not a PLE table segment of layout {LAYOUT_VERSION}")
        return cls(SegmentState(state), generation, num_rows, row_width, row_bytes,
                   RowDtype(dtype), None if math.isnan(scale) else scale, sha)


STATE_AND_GENERATION_BYTES = _STATE_AND_GENERATION.size


def ready_state_and_generation(generation: int) -> bytes:
    """The bytes at STATE_OFFSET of a READY segment of `generation`: a reader compares
    them before every gather (one slice and compare, cheaper than unpacking them)."""
    return _STATE_AND_GENERATION.pack(SegmentState.READY, LAYOUT_VERSION, generation)


def read_state(segment: mmap.mmap) -> SegmentState:
    """The state word of a mapped segment."""
    return SegmentState(_STATE.unpack_from(segment, STATE_OFFSET)[0])


def write_state(segment: mmap.mmap, state: SegmentState) -> None:
    """Sets the state word of a segment mapped for writing (the service's)."""
    _STATE.pack_into(segment, STATE_OFFSET, state)


def segment_path(shm_name: str, shm_dir: Path = SHM_DIR) -> Path:
    """Where the segment lives: /dev/shm, or another tmpfs (one mounted with huge pages)."""
    if shm_name in ("", ".", "..") or "/" in shm_name:
        raise ValueError(f"shared-memory name {shm_name!r} must be a file name: not empty, "
                         "'.' or '..', and no '/'")
    return shm_dir / shm_name


def advise_huge_pages(mapping: mmap.mmap) -> None:
    """Asks for transparent huge pages: random row gathers over tens of GB miss the TLB on
    almost every row with 4 KiB pages. The tmpfs the segment lives on decides: its `huge=`
    mount option must be within_size or always (posix_fallocate allocates the pages before
    any mapping exists, so `huge=advise` never sees this request)."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


def huge_page_bytes(mapping_start: int) -> int:
    """Bytes of the mapping at `mapping_start` that this process maps with huge pages
    (counted from /proc/self/smaps once the pages have been touched; 0 off Linux)."""
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    in_mapping = False
    total_kib = 0
    for line in smaps.splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            in_mapping = int(first.split("-")[0], 16) == mapping_start
        elif in_mapping and first in ("ShmemPmdMapped:", "FilePmdMapped:"):
            total_kib += int(line.split()[1])
    return total_kib * 1024
