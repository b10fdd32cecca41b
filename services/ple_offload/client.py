"""Engine-side access to a served table: shared memory on the service's machine, gRPC
elsewhere, and reattachment after the service restarts. Blocking: model code is synchronous."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

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
from services.ple_offload.lookup_streams import LookupStreams
from services.ple_offload.lookup_wire import LOOKUP_METHOD, decode_lookup_reply
from services.ple_offload.row_gather import as_row_ids
from services.ple_offload.segment_layout import SHM_DIR
from services.ple_offload.table_format import RowDtype
from services.ple_offload.table_reader import SharedTableReader

if TYPE_CHECKING:  # torch is imported only by engines that gather on a GPU
    import torch

    from services.ple_offload.cuda_table import CudaHostTable

logger = logging.getLogger(__name__)

_REATTACH_POLL_S = 0.2
# How often an attached client looks whether the service closed its segment.
_CLOSED_POLL_S = 0.5
# Rows, spread over the table, that a reattach compares with the ones first served.
_PROBE_ROWS = 64
# A gather over gRPC of more rows than this goes as several lookups. Each lookup gets the
# whole rpc_timeout_s, the service holds two copies of one part at a time rather than of
# the whole gather, and no reply comes near grpc's 256 MiB message limit.
_MAX_LOOKUP_BYTES = 32 * 2**20


class PleTableClient:
    """Gathers rows of the table a PLE service serves. Thread-safe."""

    def __init__(self, address: str, *, allow_shared_memory: bool = True,
                 reattach_timeout_s: float = 60.0, rpc_timeout_s: float = 5.0,
                 connect_timeout_s: float = 0.0, gather_threads: int = 1,
                 lookup_stream: bool = True) -> None:
        """`connect_timeout_s` waits for a service that is still starting or loading;
        `gather_threads` split large shared-memory gathers. Gathers over gRPC use
        LookupStream (see `LookupStreams`), or unary Lookup calls with `lookup_stream=False`
        or once the service answers LookupStream with UNIMPLEMENTED (it predates it)."""
        self.address = address
        self.allow_shared_memory = allow_shared_memory
        self.reattach_timeout_s = reattach_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.gather_threads = gather_threads
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = ple_pb2_grpc.PleOffloadStub(self._channel)
        # Lookup replies stay wire bytes, read in place by `decode_lookup_reply`.
        self._lookup = self._channel.unary_unary(
            LOOKUP_METHOD, request_serializer=ple_pb2.LookupRequest.SerializeToString,
            response_deserializer=None)
        self._lookup_streams = LookupStreams(self._channel, address) if lookup_stream else None
        self._lock = threading.Lock()
        self._reader: SharedTableReader | None = None
        # GPU gathers (enable_cuda): the device, and the registered view of the reader's
        # mapping, which every reattach drops and registers again.
        self._cuda_device: torch.device | None = None
        self._cuda_table: CudaHostTable | None = None
        self.cuda_unavailable_reason: str | None = None
        self._is_closed = threading.Event()
        self._closed_segment_watcher: threading.Thread | None = None
        try:
            self.info = self._wait_for_table(connect_timeout_s)
            self._attach(self._open_segment(self.info))
            self._probe_ids = np.linspace(0, self.info.num_rows - 1,
                                          min(_PROBE_ROWS, self.info.num_rows)).astype(np.int64)
            self._probe_rows = self._gather_once(self._probe_ids)
        except BaseException:
            self.close()  # the channel and its threads, which the caller never gets to close
            raise

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

    def gather_owned(self, row_ids: np.ndarray, valid_start: int, valid_end: int) -> np.ndarray:
        """Like `gather` (writable result), with zero rows for ids outside
        [valid_start, valid_end): the rows another ETP rank owns."""
        flat = as_row_ids(row_ids)
        owned = (flat >= valid_start) & (flat < valid_end)
        if owned.all():
            return np.require(self.gather(flat), requirements="W")
        rows = np.require(self.gather(np.where(owned, flat, 0)), requirements="W")
        rows[~owned] = 0
        return rows

    @property
    def cuda_table(self) -> CudaHostTable | None:
        """The GPU view of the attached table, when `enable_cuda` succeeded."""
        return self._cuda_table

    def enable_cuda(self, device: torch.device) -> bool:
        """Registers the shared table for gathers on `device`, now and after every
        reattach. False when it cannot be (rows over gRPC, or the driver refuses; the
        reason is logged and kept in `cuda_unavailable_reason`): `gather_cuda` then
        gathers on the host and copies. One device per client. Cheap once decided."""
        import torch

        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            if self._cuda_device is None:
                self._cuda_device = device
                self._register_cuda()
            elif self._cuda_device != device:
                logger.warning("PLE table at %s is registered for %s; %s gathers on the host",
                               self.address, self._cuda_device, device)
                return False
            return self._cuda_table is not None

    def gather_cuda(self, row_ids: torch.Tensor, valid_start: int = 0,
                    valid_end: int | None = None) -> torch.Tensor:
        """Rows for int `row_ids` on a CUDA device as uint8 [*shape, row_bytes] there,
        zero for ids outside [valid_start, valid_end). Gathered by the GPU from the
        registered shared table when `enable_cuda` succeeded, else on the host and
        copied. Reattaches after a service restart like `gather`."""
        end = self.num_rows if valid_end is None else valid_end
        generation = self.info.generation
        try:
            return self._gather_cuda_once(row_ids, valid_start, end)
        except (TableClosedError, TableUnavailableError) as exc:
            logger.warning("PLE table at %s lost (%s); reattaching", self.address, exc)
            self._reattach(generation, exc)
        return self._gather_cuda_once(row_ids, valid_start, end)

    def close(self) -> None:
        self._is_closed.set()
        if self._closed_segment_watcher is not None:
            self._closed_segment_watcher.join()
        with self._lock:
            self._detach()
        if self._lookup_streams is not None:
            self._lookup_streams.close()
        self._channel.close()

    def _gather_cuda_once(self, row_ids: torch.Tensor, valid_start: int,
                          valid_end: int) -> torch.Tensor:
        import torch

        # Held through the launch so a reattach on another thread cannot unpin the
        # mapping between the liveness check and the kernel (the launch is asynchronous
        # and short; close() then waits for the kernel before unpinning).
        with self._lock:
            table = self._cuda_table
            if table is not None:
                return table.gather(row_ids, valid_start, valid_end)
        host_ids = row_ids.reshape(-1).to("cpu", torch.int64).numpy()
        rows = torch.from_numpy(self.gather_owned(host_ids, valid_start, valid_end))
        return rows.reshape(*row_ids.shape, self.row_bytes).to(row_ids.device)

    def _register_cuda(self) -> None:
        """With the lock held (or during construction), after attaching."""
        if self._cuda_device is None or self._cuda_table is not None:
            return
        if self._reader is None:
            self.cuda_unavailable_reason = ("the table is not in this machine's shared memory "
                                            "(rows come over gRPC)")
        else:
            from services.ple_offload.cuda_table import CudaHostTable, CudaRegistrationError

            started = time.monotonic()
            try:
                self._cuda_table = CudaHostTable(self._reader, self._cuda_device)
            except CudaRegistrationError as exc:
                self.cuda_unavailable_reason = str(exc)
            else:
                self.cuda_unavailable_reason = None
                logger.info("PLE table at %s registered for GPU gathers on %s in %.1f s",
                            self.address, self._cuda_device, time.monotonic() - started)
                return
        logger.warning("PLE table at %s: no GPU gathers on %s, gathering on the host and "
                       "copying instead: %s", self.address, self._cuda_device,
                       self.cuda_unavailable_reason)

    def _detach(self) -> None:
        """Unpins the GPU view first, then unmaps: the driver must let go of the pages
        before they go."""
        if self._cuda_table is not None:
            self._cuda_table.close()
            self._cuda_table = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _gather_once(self, row_ids: np.ndarray) -> np.ndarray:
        reader = self._reader
        if reader is not None:
            return reader.gather(row_ids)
        flat = np.ascontiguousarray(as_row_ids(row_ids), dtype="<i8").reshape(-1)
        row_bytes = self.info.row_bytes
        rows_per_lookup = max(1, _MAX_LOOKUP_BYTES // row_bytes)
        if flat.size <= rows_per_lookup:
            rows = self._lookup_rows(flat, self.info.generation)  # a view of the reply
        else:
            rows = np.empty(flat.size * row_bytes, np.uint8)
            for start in range(0, flat.size, rows_per_lookup):
                part = flat[start:start + rows_per_lookup]
                rows[start * row_bytes:(start + part.size) * row_bytes] = self._lookup_rows(
                    part, self.info.generation)
        return rows.reshape(*np.shape(row_ids), row_bytes)

    def _lookup_rows(self, flat_ids: np.ndarray, generation: int) -> np.ndarray:
        """Rows for little-endian int64 `flat_ids` from the service's table `generation`,
        flat uint8."""
        request = ple_pb2.LookupRequest(row_ids_le_i64=flat_ids.tobytes())
        try:
            reply = self._request_rows(request)
        except grpc.RpcError as exc:
            raise _rpc_error(self.address, exc) from exc
        served_generation, rows = decode_lookup_reply(reply)
        if served_generation != generation:
            raise TableClosedError(f"PLE service at {self.address} restarted (generation "
                                   f"{generation:x} -> {served_generation:x})")
        return rows

    def _request_rows(self, request: ple_pb2.LookupRequest) -> bytes:
        """LookupResponse wire bytes over LookupStream, or unary Lookup once the service
        has answered LookupStream with UNIMPLEMENTED (it predates LookupStream)."""
        streams = self._lookup_streams
        if streams is not None:
            try:
                return streams.lookup(request, self.rpc_timeout_s)
            except grpc.RpcError as exc:
                if not (isinstance(exc, grpc.Call)
                        and exc.code() == grpc.StatusCode.UNIMPLEMENTED):
                    raise
            # For the rest of this client's life: asking again on every gather would add
            # a failed call to each, and a restart rarely upgrades the service.
            logger.warning("PLE service at %s has no LookupStream (an older version); "
                           "using unary Lookup calls", self.address)
            self._lookup_streams = None
            streams.close()
        return self._lookup(request, timeout=self.rpc_timeout_s)

    def _reattach(self, lost_generation: int, cause: PleError) -> None:
        with self._lock:
            if self.info.generation != lost_generation:
                return  # another thread already reattached
            self._detach()
            if self._lookup_streams is not None:
                self._lookup_streams.close_idle()
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
            reader = self._open_segment(info)
            try:
                # Before the new table is used: until then other threads' gathers wait here.
                # A refused table leaves the lost generation, so the next gather checks again.
                self._check_same_rows(info, reader)
            except BaseException:
                if reader is not None:
                    reader.close()
                raise
            self.info = info
            self._attach(reader)
            self._register_cuda()
            logger.info("reattached to PLE table at %s (generation %x, %s)", self.address,
                        info.generation, "shared memory" if self.is_local else "gRPC")

    def _check_same_rows(self, info: ple_pb2.TableInfo, reader: SharedTableReader | None) -> None:
        """Raises TableUnavailableError when the table `info` (mapped by `reader`, if local)
        differs from the first one at the probe rows. The fingerprint covers only the files'
        headers, which a table exported again with the same shapes (new weights) keeps."""
        try:
            rows = (reader.gather(self._probe_ids) if reader is not None
                    else self._lookup_rows(self._probe_ids, info.generation))
        except TableClosedError as exc:  # it restarted again; the next gather reattaches
            raise TableUnavailableError(f"PLE service at {self.address}: {exc}") from exc
        if not np.array_equal(rows.reshape(self._probe_rows.shape), self._probe_rows):
            raise TableUnavailableError(
                f"PLE service at {self.address} came back serving a different table "
                f"({info.tensor_name}: the same header, other rows); restart the engine")

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

    def _open_segment(self, info: ple_pb2.TableInfo) -> SharedTableReader | None:
        """The segment of table `info` mapped, when it is on this machine and is that
        generation; None means gRPC."""
        if not self.allow_shared_memory:
            return None
        try:
            reader = SharedTableReader(info.shm_name, shm_dir=Path(info.shm_dir or SHM_DIR),
                                       gather_threads=self.gather_threads)
        except PleError:
            return None  # not on this machine (or not yet visible)
        if (reader.generation != info.generation
                or reader.header.header_sha256 != info.header_sha256):
            reader.close()  # another service's segment by the same name
            return None
        return reader

    def _attach(self, reader: SharedTableReader | None) -> None:
        """Gathers from `reader` from now on (gRPC when None)."""
        self._reader = reader
        if reader is not None and self._closed_segment_watcher is None:
            self._closed_segment_watcher = threading.Thread(
                target=self._unmap_closed_segments, name="ple-closed-segment-watcher",
                daemon=True)
            self._closed_segment_watcher.start()

    def _unmap_closed_segments(self) -> None:
        """Unmaps a segment soon after its service closes it, instead of at the next gather,
        which an idle engine may not make for hours: a closed segment's memory stays taken
        while any process maps it, so a restarted service could find no room for its copy.
        The next gather reattaches."""
        while not self._is_closed.wait(_CLOSED_POLL_S):
            reader = self._reader
            if reader is None or reader.is_live():
                continue
            with self._lock:
                if self._reader is reader:
                    logger.info("PLE table at %s: its service closed %s; unmapped it",
                                self.address, reader.path)
                    self._detach()


def _check_same_table(old: ple_pb2.TableInfo, new: ple_pb2.TableInfo, address: str) -> None:
    if (old.header_sha256, old.num_rows, old.row_bytes, old.dtype, old.scale) != (
            new.header_sha256, new.num_rows, new.row_bytes, new.dtype, new.scale):
        raise TableUnavailableError(
            f"PLE service at {address} came back serving a different table "
            f"({new.tensor_name}, sha256 {new.header_sha256.hex()[:16]}); restart the engine")


def _rpc_error(address: str, exc: grpc.RpcError) -> PleError:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return RowIdError(details)
    return TableUnavailableError(f"PLE service at {address}: {code.name if code else 'error'}: {details}")
