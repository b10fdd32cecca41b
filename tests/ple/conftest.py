"""Shared fixtures for the PLE tests: synthetic tables and a check that no segment leaks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.ple_offload.segment_layout import SHM_DIR
from tests.ple.table_files import TableFile, random_rows, write_table

# "Millions of rows" at the real row sizes: fp8 rows of 160 values (160 B) and bf16
# rows of 160 values (320 B).
NUM_FP8_ROWS = 2_000_000
NUM_BF16_ROWS = 1_000_000
ROW_WIDTH = 160


@pytest.fixture(scope="session")
def fp8_table(tmp_path_factory: pytest.TempPathFactory) -> TableFile:
    path = tmp_path_factory.mktemp("ple") / "fp8.safetensors"
    rows = random_rows(NUM_FP8_ROWS, ROW_WIDTH, seed=1)
    return write_table(path, rows, safetensors_dtype="F8_E4M3", num_shards=8, scale=0.0137)


@pytest.fixture(scope="session")
def bf16_table(tmp_path_factory: pytest.TempPathFactory) -> TableFile:
    path = tmp_path_factory.mktemp("ple") / "bf16.safetensors"
    rows = random_rows(NUM_BF16_ROWS, ROW_WIDTH * 2, seed=2)
    return write_table(path, rows, safetensors_dtype="BF16")


@pytest.fixture(scope="session")
def small_fp8_table(tmp_path_factory: pytest.TempPathFactory) -> TableFile:
    """For lifecycle tests, where table size only adds load time."""
    path = tmp_path_factory.mktemp("ple") / "fp8-small.safetensors"
    rows = random_rows(100_000, ROW_WIDTH, seed=4)
    return write_table(path, rows, safetensors_dtype="F8_E4M3", num_shards=2, scale=0.5)


@pytest.fixture(autouse=True, scope="session")
def no_leaked_segments() -> Iterator[None]:
    before = set(SHM_DIR.glob("backport-ple-test-*"))
    yield
    leaked = set(SHM_DIR.glob("backport-ple-test-*")) - before
    for path in leaked:
        path.unlink()
    assert not leaked, f"shared-memory segments leaked: {sorted(map(str, leaked))}"


