"""The row-id check and the row gather that the service (for lookups) and the readers on
its machine (for shared-memory gathers) both run."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from services.ple_offload.errors import RowIdError


def as_row_ids(row_ids: ArrayLike) -> np.ndarray:
    """`row_ids` (any shape) as int64. Raises RowIdError for ids that are not integers:
    casting them would turn 1.7 into row 1 and serve a wrong row without a word."""
    ids = np.asarray(row_ids)
    if ids.size and ids.dtype.kind not in "iu":
        raise RowIdError(f"row ids must be integers, got {ids.dtype}")
    return ids.astype(np.int64, copy=False)


def take_checked_rows(rows: np.ndarray, flat_ids: np.ndarray, out: np.ndarray) -> None:
    """Copies rows[flat_ids] into `out`; the ids must already be in range (check_row_ids).

    mode="clip" because with the default mode="raise" numpy always buffers `out` (it
    gathers into a temporary and copies that over, so `out` stays untouched on a bad
    id): one more allocation and pass over the gathered rows on every call."""
    np.take(rows, flat_ids, axis=0, out=out, mode="clip")


def check_row_ids(flat_ids: np.ndarray, num_rows: int) -> None:
    """Raises RowIdError unless every int64 id is in [0, num_rows). One pass: viewed as
    unsigned, a negative id is larger than any row count."""
    if flat_ids.size and int(flat_ids.view(np.uint64).max()) >= num_rows:
        bad = flat_ids[(flat_ids < 0) | (flat_ids >= num_rows)]
        raise RowIdError(f"row ids out of range [0, {num_rows}): {bad[:4].tolist()}")
