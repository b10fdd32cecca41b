"""Bad table files are refused before any memory is taken, with a message naming the problem."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from services.ple_offload.errors import TableFileError
from services.ple_offload.table_format import RowDtype, TableExpectation, find_table
from tests.ple.service_process import REPO_ROOT, service_command, service_env, unique_shm_name
from tests.ple.table_files import STEM, random_rows, write_table


@pytest.fixture
def small_rows() -> np.ndarray:
    return random_rows(10_000, 160, seed=3)


def test_reads_shape_dtype_scale_and_fingerprint(tmp_path: Path, small_rows: np.ndarray) -> None:
    table = write_table(tmp_path / "t.safetensors", small_rows, safetensors_dtype="F8_E4M3",
                        num_shards=3, scale=0.25)
    source = find_table(table.path, None)
    assert (source.tensor_name, source.num_rows, source.row_width, source.dtype, source.scale) == (
        STEM, 10_000, 160, RowDtype.FLOAT8_E4M3FN, 0.25)
    assert [s.name for s in source.segments] == [f"{STEM}.shard_{i}.weight" for i in range(3)]
    again = write_table(tmp_path / "u.safetensors", small_rows, safetensors_dtype="F8_E4M3",
                        num_shards=3, scale=0.25)
    assert find_table(again.path, STEM).header_sha256 == source.header_sha256


def test_truncated_file_is_refused(tmp_path: Path, small_rows: np.ndarray) -> None:
    table = write_table(tmp_path / "t.safetensors", small_rows, safetensors_dtype="BF16")
    os.truncate(table.path, table.path.stat().st_size - 1000)
    with pytest.raises(TableFileError, match="truncated"):
        find_table(table.path, None)


@pytest.mark.parametrize(("expect", "message"), [
    (TableExpectation(dtype=RowDtype.BFLOAT16), "dtype FLOAT8_E4M3FN, expected BFLOAT16"),
    (TableExpectation(num_rows=123), "10000 rows, expected 123"),
    (TableExpectation(row_width=2560), "row width 160, expected 2560"),
    (TableExpectation(header_sha256_hex="00" * 32), "header fingerprint"),
])
def test_mismatched_table_is_refused(tmp_path: Path, small_rows: np.ndarray,
                                     expect: TableExpectation, message: str) -> None:
    table = write_table(tmp_path / "t.safetensors", small_rows, safetensors_dtype="F8_E4M3",
                        scale=1.0)
    with pytest.raises(TableFileError, match=message):
        find_table(table.path, None, expect)


@pytest.mark.parametrize(("header", "message"), [
    ({f"{STEM}.weight": {"dtype": "BF16", "shape": [4, 160]}}, "malformed header entry"),
    ({f"{STEM}.weight": {"dtype": "BF16", "shape": [4, 160], "data_offsets": [0]}},
     "malformed header entry"),
    ({f"{STEM}.weight": "BF16"}, "malformed header entry"),
    ({f"{STEM}.weight": {"dtype": "BF16", "shape": [4, 160], "data_offsets": [1280, 0]}},
     "data_offsets 1280..0"),
    ([1, 2, 3], "not a JSON object"),
    # Before, these three were served (no rows, rows of no bytes) or crashed the service's
    # start with a traceback (ValueError: Value out of range: -2) ...
    ({f"{STEM}.weight": {"dtype": "BF16", "shape": [0, 160], "data_offsets": [0, 0]}},
     "is 0 rows x 160; a table needs at least one row"),
    ({f"{STEM}.weight": {"dtype": "BF16", "shape": [4, 0], "data_offsets": [0, 0]}},
     "is 4 rows x 0; a table needs at least one row"),
    ({f"{STEM}.weight": {"dtype": "BF16", "shape": [-2, -320], "data_offsets": [0, 1280]}},
     "is -2 rows x -320; a table needs at least one row"),
    # ... and an fp8 scale whose range holds no bytes read the next 4 bytes as the scale,
    # or crashed at the end of the file (struct.error).
    ({f"{STEM}.weight": {"dtype": "F8_E4M3", "shape": [8, 160], "data_offsets": [0, 1280]},
      f"{STEM}.weight_scale": {"dtype": "F32", "shape": [1], "data_offsets": [1280, 1280]}},
     "weight_scale byte range does not match its shape [(]0 bytes, not 4[)]"),
], ids=["no offsets", "one offset", "entry not an object", "offsets reversed", "a list",
        "no rows", "no values a row", "negative sizes", "scale of no bytes"])
def test_malformed_header_is_refused_by_name(tmp_path: Path, header: object,
                                             message: str) -> None:
    encoded = json.dumps(header).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(1280))
    with pytest.raises(TableFileError, match=message):
        find_table(path, None)


def test_fp8_table_without_scale_is_refused(tmp_path: Path, small_rows: np.ndarray) -> None:
    table = write_table(tmp_path / "t.safetensors", small_rows, safetensors_dtype="F8_E4M3")
    with pytest.raises(TableFileError, match="weight_scale"):
        find_table(table.path, None)


def test_service_exits_with_the_reason_for_a_bad_file(tmp_path: Path, small_rows: np.ndarray) -> None:
    table = write_table(tmp_path / "t.safetensors", small_rows, safetensors_dtype="BF16")
    os.truncate(table.path, table.path.stat().st_size // 2)
    shm_name = unique_shm_name()
    result = subprocess.run(
        service_command(table.path, "--shm-name", shm_name, "--address", "127.0.0.1:0"),
        cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "is truncated" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not Path("/dev/shm", shm_name).exists()


def test_table_with_a_missing_shard_is_refused(tmp_path: Path, small_rows: np.ndarray) -> None:
    table = write_table(tmp_path / "t.safetensors", small_rows, safetensors_dtype="BF16",
                        num_shards=3)
    data = table.path.read_bytes()
    table.path.write_bytes(data.replace(b".shard_1.weight", b".shard_7.weight", 1))
    with pytest.raises(TableFileError, match=r"missing shards \[1, 3, 4, 5, 6\]"):
        find_table(table.path, None)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.5])
def test_an_fp8_scale_that_is_no_positive_number_is_refused(
        tmp_path: Path, small_rows: np.ndarray, scale: float) -> None:
    """Was served: its rows as garbage, and with NaN no client could reattach (NaN != NaN)."""
    table = write_table(tmp_path / "t.safetensors", small_rows, safetensors_dtype="F8_E4M3",
                        scale=scale)
    with pytest.raises(TableFileError, match="an fp8 table's scale is a positive number"):
        find_table(table.path, None)


def test_a_tensor_in_two_files_of_a_folder_is_refused(tmp_path: Path,
                                                       small_rows: np.ndarray) -> None:
    """Was served from the file that sorts last."""
    for name in ("a.safetensors", "b.safetensors"):
        write_table(tmp_path / name, small_rows, safetensors_dtype="BF16")
    with pytest.raises(TableFileError,
                       match=f"{STEM}.weight is in both a.safetensors and b.safetensors"):
        find_table(tmp_path, None)
