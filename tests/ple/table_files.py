"""Writes synthetic PLE tables as safetensors files, fast enough for millions of rows."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STEM = "model.layers.3.ple.ple_embedding.ngram_embedding"


@dataclass(frozen=True)
class TableFile:
    path: Path
    stem: str
    rows: np.ndarray  # uint8 [num_rows, row_bytes], exactly the bytes in the file
    safetensors_dtype: str
    row_width: int
    scale: float | None


def random_rows(num_rows: int, row_bytes: int, seed: int) -> np.ndarray:
    """Distinct pseudo-random rows: a few thousand random rows repeated, each stamped with
    its own row id, so any wrong-row or torn read changes bytes. About 10x faster than
    fresh random bytes for hundreds of MB."""
    base = np.random.default_rng(seed).integers(0, 256, (4099, row_bytes), dtype=np.uint8)
    row_ids = np.arange(num_rows, dtype=np.int64)
    rows = base[row_ids % base.shape[0]]
    rows[:, :8] ^= row_ids.view(np.uint8).reshape(num_rows, 8)
    return rows


def write_table(path: Path, rows: np.ndarray, *, safetensors_dtype: str, num_shards: int = 1,
                scale: float | None = None, stem: str = STEM) -> TableFile:
    """Writes `rows` (uint8 bytes of the stored dtype) as `<stem>.weight` or as
    `num_shards` Qwen4Exp-style row shards `<stem>.shard_<i>.weight`."""
    itemsize = {"F8_E4M3": 1, "BF16": 2}[safetensors_dtype]
    num_rows, row_bytes = rows.shape
    width = row_bytes // itemsize
    header: dict[str, dict] = {}
    blobs: list[tuple[int, int, np.ndarray | bytes]] = []
    offset = 0

    def add(name: str, dtype: str, shape: list[int], blob: np.ndarray | bytes) -> None:
        nonlocal offset
        size = blob.nbytes if isinstance(blob, np.ndarray) else len(blob)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        blobs.append((offset, size, blob))
        offset += size

    if num_shards == 1:
        add(f"{stem}.weight", safetensors_dtype, [num_rows, width], rows)
    else:
        shard_rows = -(-num_rows // num_shards)
        for i in range(num_shards):
            part = rows[i * shard_rows:(i + 1) * shard_rows]
            add(f"{stem}.shard_{i}.weight", safetensors_dtype, [part.shape[0], width], part)
    if scale is not None:
        add(f"{stem}.weight_scale", "F32", [], struct.pack("<f", scale))
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for _, _, blob in blobs:
            f.write(memoryview(np.ascontiguousarray(blob)) if isinstance(blob, np.ndarray) else blob)
    return TableFile(path, stem, rows, safetensors_dtype, width, scale)


def write_sparse_table(path: Path, num_rows: int, row_bytes: int, *,
                       stem: str = STEM) -> None:
    """A bf16-typed table of zero rows whose data is a hole in the file: multi-GB in no
    time and no disk. The service still writes every byte into shared memory."""
    width = row_bytes // 2
    header = {f"{stem}.weight": {"dtype": "BF16", "shape": [num_rows, width],
                                 "data_offsets": [0, num_rows * row_bytes]}}
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        f.truncate(8 + len(header_bytes) + num_rows * row_bytes)
