"""Finds and validates a PLE table inside safetensors files, without reading its rows.

A table is one 2-D tensor `<stem>.weight`, or the row shards `<stem>.shard_<i>.weight`
(i = 0, 1, ...) that Qwen4Exp checkpoints split it into, stacked in shard order. fp8
tables carry one float32 scale, `<stem>.weight_scale`.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from services.ple_offload.errors import TableFileError

_SHARD_PATTERN = re.compile(r"^(?P<stem>.+)\.shard_(?P<index>\d+)\.weight$")
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class RowDtype(enum.IntEnum):
    """Row storage types; values match `backport.v1.RowDtype`."""

    FLOAT8_E4M3FN = 1
    BFLOAT16 = 2

    @property
    def itemsize(self) -> int:
        return 1 if self is RowDtype.FLOAT8_E4M3FN else 2

    @classmethod
    def from_safetensors(cls, name: str) -> RowDtype | None:
        return {"F8_E4M3": cls.FLOAT8_E4M3FN, "BF16": cls.BFLOAT16}.get(name)

    @classmethod
    def from_setting(cls, name: str) -> RowDtype:
        names = {"fp8": cls.FLOAT8_E4M3FN, "float8_e4m3fn": cls.FLOAT8_E4M3FN,
                 "bf16": cls.BFLOAT16, "bfloat16": cls.BFLOAT16}
        if name.lower() not in names:
            raise ValueError(f"unknown row dtype {name!r}; use one of {sorted(names)}")
        return names[name.lower()]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor's place in one safetensors file."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    data_start: int  # absolute byte offset in the file
    data_end: int


@dataclass(frozen=True, slots=True)
class SafetensorsFile:
    path: Path
    header_bytes: bytes
    tensors: dict[str, TensorEntry]


@dataclass(frozen=True, slots=True)
class TableSource:
    """Where a table's rows lie on disk and what they are."""

    tensor_name: str
    dtype: RowDtype
    num_rows: int
    row_width: int
    scale: float | None
    header_sha256: bytes
    segments: tuple[TensorEntry, ...]  # row blocks in table order

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.dtype.itemsize

    @property
    def table_bytes(self) -> int:
        return self.num_rows * self.row_bytes


@dataclass(frozen=True, slots=True)
class TableExpectation:
    """What the operator says the table must be; None skips that check."""

    dtype: RowDtype | None = None
    num_rows: int | None = None
    row_width: int | None = None
    header_sha256_hex: str | None = None


def read_safetensors_header(path: Path) -> SafetensorsFile:
    """Parses the header and checks that every tensor's bytes lie inside the file."""
    try:
        file_bytes = os.stat(path).st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise TableFileError(f"{path}: {file_bytes} bytes is too short for a safetensors file")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > file_bytes:
                raise TableFileError(
                    f"{path}: header length {header_len} does not fit a {file_bytes}-byte file "
                    "(truncated or not safetensors)")
            header_bytes = f.read(header_len)
    except OSError as exc:
        raise TableFileError(f"cannot read table file {path}: {exc}") from exc
    try:
        header = json.loads(header_bytes)
    except ValueError as exc:
        raise TableFileError(f"{path}: header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise TableFileError(f"{path}: header is not a JSON object (not safetensors)")
    data_base = 8 + header_len
    tensors: dict[str, TensorEntry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(offset) for offset in meta["data_offsets"])
            entry = TensorEntry(path, name, str(meta["dtype"]),
                                tuple(int(size) for size in meta["shape"]),
                                data_base + begin, data_base + end)
        except (KeyError, TypeError, ValueError) as exc:
            raise TableFileError(f"{path}: tensor {name!r} has a malformed header entry "
                                 f"{json.dumps(meta)[:200]} ({exc!r})") from exc
        if not 0 <= begin <= end:
            raise TableFileError(f"{path}: tensor {name!r} has data_offsets {begin}..{end}")
        if entry.data_end > file_bytes:
            raise TableFileError(
                f"{path} is truncated: tensor {name!r} ends at byte {entry.data_end} "
                f"but the file has {file_bytes} bytes")
        tensors[name] = entry
    return SafetensorsFile(path, bytes(prefix + header_bytes), tensors)


def find_table(table_path: Path, tensor_name: str | None,
               expect: TableExpectation = TableExpectation()) -> TableSource:
    """Resolves and validates the table in a safetensors file or a folder of them."""
    files = _list_files(table_path)
    headers = [read_safetensors_header(p) for p in files]
    entries: dict[str, TensorEntry] = {}
    for h in headers:
        for name, entry in h.tensors.items():
            # Which copy would be served is the files' sort order, not the checkpoint's intent.
            if name in entries:
                raise TableFileError(f"{name} is in both {entries[name].path.name} and "
                                     f"{entry.path.name}")
            entries[name] = entry
    stem = tensor_name or _guess_stem(entries, table_path)
    segments = _table_segments(entries, stem, table_path)
    source = _describe(stem, segments, entries, headers)
    _check_expectation(source, expect, table_path)
    return source


def _list_files(table_path: Path) -> list[Path]:
    if table_path.is_dir():
        files = sorted(table_path.glob("*.safetensors"))
        if not files:
            raise TableFileError(f"no .safetensors files in {table_path}")
        return files
    if not table_path.exists():
        raise TableFileError(f"table file {table_path} does not exist")
    return [table_path]


def _guess_stem(entries: dict[str, TensorEntry], table_path: Path) -> str:
    stems = {m["stem"] for name in entries if (m := _SHARD_PATTERN.match(name))}
    if not stems:
        stems = {name.removesuffix(".weight") for name, e in entries.items()
                 if len(e.shape) == 2 and name.endswith(".weight")}
    if len(stems) != 1:
        raise TableFileError(
            f"{table_path}: cannot tell which tensor is the table (candidates: "
            f"{sorted(stems) or 'none'}); set tensor_name")
    return stems.pop()


def _table_segments(entries: dict[str, TensorEntry], stem: str,
                    table_path: Path) -> list[TensorEntry]:
    if f"{stem}.weight" in entries:
        return [entries[f"{stem}.weight"]]
    shard_indices = sorted(int(m["index"]) for name in entries
                           if (m := _SHARD_PATTERN.match(name)) and m["stem"] == stem)
    if not shard_indices:
        raise TableFileError(f"{table_path}: no tensor {stem}.weight or {stem}.shard_<i>.weight")
    if shard_indices != list(range(len(shard_indices))):
        missing = sorted(set(range(shard_indices[-1] + 1)) - set(shard_indices))
        raise TableFileError(f"{table_path}: table {stem} is missing shards {missing[:8]}")
    return [entries[f"{stem}.shard_{i}.weight"] for i in shard_indices]


def _describe(stem: str, segments: list[TensorEntry], entries: dict[str, TensorEntry],
              headers: list[SafetensorsFile]) -> TableSource:
    first = segments[0]
    dtype = RowDtype.from_safetensors(first.dtype)
    if dtype is None:
        raise TableFileError(f"table {stem} has dtype {first.dtype}; only F8_E4M3 and BF16 are served")
    for seg in segments:
        if len(seg.shape) != 2 or seg.dtype != first.dtype or seg.shape[1] != first.shape[1]:
            raise TableFileError(
                f"{seg.path}: {seg.name} is {seg.dtype}{list(seg.shape)}, "
                f"expected {first.dtype}[rows, {first.shape[1]}] like {first.name}")
        if seg.data_end - seg.data_start != math.prod(seg.shape) * dtype.itemsize:
            raise TableFileError(f"{seg.path}: {seg.name} byte range does not match its shape")
    num_rows = sum(s.shape[0] for s in segments)
    # The byte-range check passes a shape of two negative sizes (their product is the
    # range) and an empty table; either would be served, or crash the service's start.
    if num_rows <= 0 or first.shape[1] <= 0:
        raise TableFileError(f"table {stem} is {num_rows} rows x {first.shape[1]}; a table "
                             "needs at least one row of at least one value")
    scale = _read_scale(entries.get(f"{stem}.weight_scale"), stem) if dtype is RowDtype.FLOAT8_E4M3FN else None
    digest = hashlib.sha256()
    used = {seg.path for seg in segments}
    for h in headers:
        if h.path in used:
            digest.update(h.header_bytes)
    return TableSource(stem, dtype, num_rows, first.shape[1], scale, digest.digest(),
                       tuple(segments))


def _read_scale(entry: TensorEntry | None, stem: str) -> float:
    if entry is None:
        raise TableFileError(f"fp8 table {stem} has no {stem}.weight_scale tensor")
    if entry.dtype != "F32" or math.prod(entry.shape) != 1:
        raise TableFileError(f"{entry.name} must be one F32 value, got {entry.dtype}{list(entry.shape)}")
    # The shape check does not cover the byte range: any other range than 4 bytes would
    # read other bytes as the scale, or fail with a traceback at the end of the file.
    if entry.data_end - entry.data_start != 4:
        raise TableFileError(f"{entry.path}: {entry.name} byte range does not match its shape "
                             f"({entry.data_end - entry.data_start} bytes, not 4)")
    with open(entry.path, "rb") as f:
        f.seek(entry.data_start)
        scale = struct.unpack("<f", f.read(4))[0]
    # A NaN would also never equal itself, so clients would refuse every reattach.
    if not (math.isfinite(scale) and scale > 0):
        raise TableFileError(f"{entry.name} is {scale}; an fp8 table's scale is a positive number")
    return scale


def _check_expectation(source: TableSource, expect: TableExpectation, table_path: Path) -> None:
    problems = []
    if expect.dtype is not None and source.dtype is not expect.dtype:
        problems.append(f"dtype {source.dtype.name}, expected {expect.dtype.name}")
    if expect.num_rows is not None and source.num_rows != expect.num_rows:
        problems.append(f"{source.num_rows} rows, expected {expect.num_rows}")
    if expect.row_width is not None and source.row_width != expect.row_width:
        problems.append(f"row width {source.row_width}, expected {expect.row_width}")
    if (expect.header_sha256_hex is not None
            and source.header_sha256.hex() != expect.header_sha256_hex.lower()):
        problems.append(f"header fingerprint {source.header_sha256.hex()}, "
                        f"expected {expect.header_sha256_hex.lower()}")
    if problems:
        raise TableFileError(f"{table_path}: table {source.tensor_name} does not match: "
                             + "; ".join(problems))
