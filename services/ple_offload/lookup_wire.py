"""LookupResponse wire bytes, written by the service and read by the client without protobuf
message objects: a decode step's reply is 160 KiB of rows, and building or parsing the
message would copy them (docs/ple.md, "What a LookupStream round trip costs")."""

from __future__ import annotations

import numpy as np
from backport.v1 import ple_pb2

from services.mesh.channels import MAX_MESSAGE_BYTES
from services.mesh.service_names import PLE_GRPC
from services.ple_offload.row_gather import take_checked_rows

LOOKUP_METHOD = f"/{PLE_GRPC}/Lookup"
LOOKUP_STREAM_METHOD = f"/{PLE_GRPC}/LookupStream"

# The layout `encode_lookup_reply` writes: generation (field 2, fixed64) first, so its
# 8 bytes sit at a fixed offset, then rows (field 1, length-delimited) up to the end.
_GENERATION_TAG = 2 << 3 | 1
_ROWS_TAG = 1 << 3 | 2
_GENERATION_END = 9  # the tag byte and 8 little-endian bytes
_MAX_VARINT_BYTES = 10
_MAX_HEAD_BYTES = _GENERATION_END + 1 + _MAX_VARINT_BYTES


def max_rows_per_reply(row_bytes: int) -> int:
    """The most rows one LookupResponse carries: grpc fails a message over the mesh's
    MAX_MESSAGE_BYTES (256 MiB, about 1.6 M rows of 160 B), on both ends."""
    return max(1, (MAX_MESSAGE_BYTES - _MAX_HEAD_BYTES) // row_bytes)


def encode_lookup_reply(rows: np.ndarray, ids: np.ndarray, generation: int) -> bytes:
    """LookupResponse wire bytes for rows[ids]; the ids must be checked already
    (check_row_ids). One gather, into an uninitialized buffer (a zero-filled bytearray cost
    about 25 us more a decode step), and one copy into the `bytes` grpc requires (it
    refuses a bytearray or memoryview). Building the message would copy the rows three
    more times (ndarray -> bytes -> message field -> serialized message)."""
    gathered = np.empty((ids.size, rows.shape[1]), np.uint8)
    take_checked_rows(rows, ids, gathered)
    head = (bytes([_GENERATION_TAG]) + generation.to_bytes(8, "little") + bytes([_ROWS_TAG])
            + _varint(gathered.nbytes))
    return b"".join((head, gathered))


def decode_lookup_reply(reply: bytes) -> tuple[int, np.ndarray]:
    """(generation, rows) of LookupResponse wire bytes; rows as flat read-only uint8.

    A reply laid out the way `encode_lookup_reply` writes it is read in place: the rows
    are a view of `reply`, not a copy. Any other valid encoding (protobuf's own writes
    the rows first) is parsed by protobuf, which copies the rows twice. Bytes that are
    not a LookupResponse raise google.protobuf.message.DecodeError."""
    rows_start = _rows_start(reply)
    if rows_start is None:
        message = ple_pb2.LookupResponse.FromString(reply)
        return message.generation, np.frombuffer(message.rows, np.uint8)
    generation = int.from_bytes(reply[1:_GENERATION_END], "little")
    return generation, np.frombuffer(reply, np.uint8, len(reply) - rows_start, rows_start)


def _rows_start(reply: bytes) -> int | None:
    """Where the rows begin when `reply` is exactly the generation field followed by a
    rows field that runs to the end; None for any other layout."""
    if (len(reply) <= _GENERATION_END + 1 or reply[0] != _GENERATION_TAG
            or reply[_GENERATION_END] != _ROWS_TAG):
        return None
    length = 0
    varint_start = _GENERATION_END + 1
    for position in range(varint_start, min(len(reply), varint_start + _MAX_VARINT_BYTES)):
        byte = reply[position]
        length |= (byte & 0x7F) << 7 * (position - varint_start)
        if byte < 0x80:
            rows_start = position + 1
            return rows_start if rows_start + length == len(reply) else None
    return None


def _varint(value: int) -> bytes:
    encoded = bytearray()
    while value > 0x7F:
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)
