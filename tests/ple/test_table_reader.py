"""A segment a reader cannot use is refused with TableUnavailableError, the error that
sends a client to gRPC, whatever is wrong with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.ple_offload.errors import TableUnavailableError
from services.ple_offload.segment_layout import (
    DATA_OFFSET_BYTES,
    LAYOUT_VERSION,
    STATE_OFFSET,
    SegmentHeader,
    SegmentState,
)
from services.ple_offload.table_format import RowDtype
from services.ple_offload.table_reader import SharedTableReader

NUM_ROWS = 8
ROW_BYTES = 160


def _segment(tmp_path: Path, header: bytes) -> str:
    name = "segment"
    (tmp_path / name).write_bytes(header.ljust(DATA_OFFSET_BYTES + NUM_ROWS * ROW_BYTES, b"\0"))
    return name


def _header(state: int = SegmentState.READY, version: int = LAYOUT_VERSION) -> bytes:
    packed = bytearray(SegmentHeader(SegmentState.READY, 1, NUM_ROWS, ROW_BYTES, ROW_BYTES,
                                     RowDtype.FLOAT8_E4M3FN, 1.0, bytes(32)).pack())
    packed[STATE_OFFSET:STATE_OFFSET + 8] = state.to_bytes(4, "little") + version.to_bytes(
        4, "little")
    return bytes(packed)


def test_a_valid_segment_is_read(tmp_path: Path) -> None:
    reader = SharedTableReader(_segment(tmp_path, _header()), shm_dir=tmp_path)
    try:
        assert reader.gather([[0, NUM_ROWS - 1]]).shape == (1, 2, ROW_BYTES)
    finally:
        reader.close()


@pytest.mark.parametrize(("header", "message"), [
    (_header(version=LAYOUT_VERSION + 1), f"not a PLE table segment of layout {LAYOUT_VERSION}"),
    (_header(state=7), "7 is not a valid SegmentState"),
    (b"something else entirely", "not a PLE table segment"),
], ids=["newer layout", "unknown state", "foreign file"])
def test_a_segment_it_cannot_read_is_unavailable(tmp_path: Path, header: bytes,
                                                 message: str) -> None:
    name = _segment(tmp_path, header)
    with pytest.raises(TableUnavailableError, match=message):
        SharedTableReader(name, shm_dir=tmp_path, gather_threads=2)
