"""Engine-side access to a served table: shared memory on the service's machine, gRPC
elsewhere, and reattachment after the service restarts. Blocking: model code is synchronous."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from backport.v1 import ple_pb2, ple_pb2_grpc

from services.mesh.channels import GRPC_OPTIONS
from services.ple_offload.errors import (
    PleError,
    RowIdError,
    TableClosedError,
    TableUnavailableError,
)
from services.ple_offload.segment_layout import SHM_DIR
from services.ple_offload.table_format import RowDtype
from services.ple_offload.table_reader import SharedTableReader

logger = logging.getLogger(__name__)

_REATTACH_POLL_S = 0.2


class PleTableClient:
    """Gathers rows of the table a PLE service serves. Thread-safe."""

    def __init__(self, address: str, *, allow_shared_memory: bool = True,
                 reattach_timeout_s: float = 60.0, rpc_timeout_s: float = 5.0,
                 connect_timeout_s: float = 0.0, gather_threads: int = 1) -> None:
        """`connect_timeout_s` waits for a service that is still starting or loading;
        `gather_threads` split large shared-memory gathers."""
        self.address = address
        self.allow_shared_memory = allow_shared_memory
        self.reattach_timeout_s = reattach_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.gather_threads = gather_threads
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = ple_pb2_grpc.PleOffloadStub(self._channel)
        self._lock = threading.Lock()
        self._reader: SharedTableReader | None = None
        self.info = self._wait_for_table(connect_timeout_s)
        self._attach_shared_memory()

    @property
    def is_local(self) -> bool:
        """True when rows come from this machine's shared memory, not over gRPC."""
        return self._reader is not None

    @property
    def num_rows(self) -> int:
        return self.info.num_rows

    @property
    def row_bytes(self) -> int:
        return self.info.row_bytes

    @property
    def dtype(self) -> RowDtype:
        return RowDtype(self.info.dtype)

    def gather(self, row_ids: np.ndarray) -> np.ndarray:
        """Rows for int64 `row_ids` of any shape, as uint8 [*row_ids.shape, row_bytes].

        After a service restart the first call reattaches (waiting up to
        `reattach_timeout_s`) and retries once; TableUnavailableError says why it could not."""
        generation = self.info.generation
        try:
            return self._gather_once(row_ids)
        except (TableClosedError, TableUnavailableError) as exc:
            logger.warning("PLE table at %s lost (%s); reattaching", self.address, exc)
            self._reattach(generation, exc)
        return self._gather_once(row_ids)

    def close(self) -> None:
        with self._lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        self._channel.close()

    def _gather_once(self, row_ids: np.ndarray) -> np.ndarray:
        reader = self._reader
        if reader is not None:
            return reader.gather(row_ids)
        flat = np.ascontiguousarray(row_ids, dtype="<i8")
        try:
            reply = self._stub.Lookup(ple_pb2.LookupRequest(row_ids_le_i64=flat.tobytes()),
                                      timeout=self.rpc_timeout_s)
        except grpc.RpcError as exc:
            raise _rpc_error(self.address, exc) from exc
        if reply.generation != self.info.generation:
            raise TableClosedError(f"PLE service at {self.address} restarted (generation "
                                   f"{self.info.generation:x} -> {reply.generation:x})")
        rows = np.frombuffer(reply.rows, np.uint8)
        return rows.reshape(*np.shape(row_ids), self.info.row_bytes)

    def _reattach(self, lost_generation: int, cause: PleError) -> None:
        with self._lock:
            if self.info.generation != lost_generation:
                return  # another thread already reattached
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            deadline = time.monotonic() + self.reattach_timeout_s
            while True:
                try:
                    info = self.describe()
                    # A failed RPC to a service that is still up (same generation) needs
                    # only a retry; a closed segment means waiting for the next generation.
                    if (info.generation != lost_generation
                            or not isinstance(cause, TableClosedError)):
                        break
                except TableUnavailableError:
                    pass
                if time.monotonic() >= deadline:
                    raise TableUnavailableError(
                        f"PLE service at {self.address} did not come back within "
                        f"{self.reattach_timeout_s:g} s after: {cause}") from cause
                time.sleep(_REATTACH_POLL_S)
            _check_same_table(self.info, info, self.address)
            self.info = info
            self._attach_shared_memory()
            logger.info("reattached to PLE table at %s (generation %x, %s)", self.address,
                        info.generation, "shared memory" if self.is_local else "gRPC")

    def _wait_for_table(self, timeout_s: float) -> ple_pb2.TableInfo:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.describe()
            except TableUnavailableError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(_REATTACH_POLL_S)

    def describe(self) -> ple_pb2.TableInfo:
        """The served table's description (one unary RPC)."""
        try:
            return self._stub.Describe(ple_pb2.DescribeRequest(), timeout=self.rpc_timeout_s)
        except grpc.RpcError as exc:
            raise _rpc_error(self.address, exc) from exc

    def _attach_shared_memory(self) -> None:
        """Maps the service's segment when it is on this machine and is the same generation."""
        if not self.allow_shared_memory:
            return
        try:
            reader = SharedTableReader(self.info.shm_name, shm_dir=Path(self.info.shm_dir or SHM_DIR),
                                       gather_threads=self.gather_threads)
        except PleError:
            return  # not on this machine (or not yet visible): use gRPC
        if (reader.generation != self.info.generation
                or reader.header.header_sha256 != self.info.header_sha256):
            reader.close()  # another service's segment by the same name
            return
        self._reader = reader


def _check_same_table(old: ple_pb2.TableInfo, new: ple_pb2.TableInfo, address: str) -> None:
    if (old.header_sha256, old.num_rows, old.row_bytes, old.dtype) != (
            new.header_sha256, new.num_rows, new.row_bytes, new.dtype):
        raise TableUnavailableError(
            f"PLE service at {address} came back serving a different table "
            f"({new.tensor_name}, sha256 {new.header_sha256.hex()[:16]}); restart the engine")


def _rpc_error(address: str, exc: grpc.RpcError) -> PleError:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return RowIdError(details)
    return TableUnavailableError(f"PLE service at {address}: {code.name if code else 'error'}: {details}")
