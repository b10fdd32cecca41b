"""GPU gathers straight from this machine's one shared copy of the table.

The reader's read-only mapping of the segment is registered with the CUDA driver: its
pages are pinned where they are, nothing is copied. Under UVA a registered host pointer
is also a device pointer, so the rows become a zero-copy CUDA tensor and
`torch.index_select` on the GPU reads just the rows it needs over PCIe, as vLLM's
pinned-host PLE table does, without a per-process pinned copy and without a host gather
and host-to-device copy per step.

The driver API (libcuda, through ctypes) registers and unregisters rather than the
runtime that `torch.cuda.cudart()` wraps: a refused runtime call leaves the runtime's
"last error" set, and torch's next kernel launch check would report it as its own
failure. Driver calls leave that state alone, so a refusal falls back cleanly.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

from services.ple_offload.errors import PleError, RowIdError
from services.ple_offload.segment_layout import DATA_OFFSET_BYTES
from services.ple_offload.table_reader import SharedTableReader

logger = logging.getLogger(__name__)

# cuMemHostRegister flags (the same values as cudaHostRegister's).
REGISTER_PORTABLE = 1  # visible to every context, not only the one current at registration
REGISTER_DEVICEMAP = 2  # mapped into the device address space
REGISTER_READ_ONLY = 8  # required to pin a PROT_READ mapping: the GPU may not write it

# CUdevice_attribute values (cuda.h).
_ATTR_PAGEABLE_MEMORY_ACCESS = 88
_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
_ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED = 113

# Widest word that divides a row: index_select copies one element per thread, so 8-byte
# words move a 160-byte row in 20 reads over PCIe instead of 160.
_WORD_TYPES = ((8, "<i8", torch.int64), (4, "<i4", torch.int32), (2, "<i2", torch.int16),
               (1, "|u1", torch.uint8))


class CudaRegistrationError(PleError):
    """The GPU cannot read the shared table in place; the reason says why (driver,
    device or platform). Callers fall back to gathering on the host."""


class CudaHostTable:
    """The rows of one attached table generation as a CUDA tensor that reads host memory.

    Valid while the reader stays attached: `close` (before the reader unmaps) waits for
    queued kernels, then unpins. Tensors returned by `gather` are ordinary device tensors
    and stay valid; `rows` and views of it do not outlive `close`."""

    def __init__(self, reader: SharedTableReader, device: torch.device) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"need a CUDA device with an index, got {device}")
        self.reader = reader
        self.device = device
        self.num_rows = reader.header.num_rows
        self.row_bytes = reader.header.row_bytes
        driver = _driver()
        self._driver = driver
        self._ordinal = device.index
        unsupported = driver.why_not_supported(self._ordinal)
        if unsupported:
            raise CudaRegistrationError(unsupported)
        address, size = reader.mapped_region()
        driver.register(self._ordinal, address, size,
                        REGISTER_PORTABLE | REGISTER_DEVICEMAP | REGISTER_READ_ONLY)
        self.address: int | None = address
        try:
            word_bytes, typestr, word_dtype = next(w for w in _WORD_TYPES if self.row_bytes % w[0] == 0)
            # canUseHostPointerForRegisteredMem = 1 (checked above): the host address is
            # the device address, so the data pointer needs no translation.
            # device= keeps torch from moving the wrapped table to a default device.
            words = torch.as_tensor(_CudaArray(address + DATA_OFFSET_BYTES,
                                               (self.num_rows, self.row_bytes // word_bytes), typestr),
                                    device=device)
            if words.device != device or words.data_ptr() != address + DATA_OFFSET_BYTES:
                raise CudaRegistrationError(
                    f"torch placed the registered table on {words.device} at "
                    f"{words.data_ptr():#x}, not on {device} at {address + DATA_OFFSET_BYTES:#x}")
            assert words.dtype == word_dtype
            # torch >= 2.9 wraps a host pointer for device= without asking whether it is
            # registered, and the first kernel then faults: ask the driver instead.
            if not driver.is_registered(self._ordinal, address):
                raise CudaRegistrationError(f"the registration of {address:#x} did not hold")
        except Exception as exc:
            driver.unregister(self._ordinal, address)
            self.address = None
            if isinstance(exc, CudaRegistrationError):
                raise
            raise CudaRegistrationError(f"torch could not wrap the registered table: {exc}") from exc
        self._words: torch.Tensor | None = words
        self.rows: torch.Tensor | None = words.view(torch.uint8)  # [num_rows, row_bytes]

    def gather(self, row_ids: torch.Tensor, valid_start: int = 0,
               valid_end: int | None = None) -> torch.Tensor:
        """Rows for `row_ids` (on this device, any shape) as uint8 [*shape, row_bytes] on
        the device, asynchronously on the current stream.

        Ids outside [valid_start, valid_end) get zero rows (another ETP rank owns them).
        With the whole table valid (the default), ids are not checked on the host: that
        would cost a device-to-host sync per step. An id outside [0, num_rows) is then a
        device-side assert, as in torch's embedding. Raises TableClosedError once the
        service has closed this generation."""
        words = self._words
        if words is None:
            raise RuntimeError("the GPU view of the PLE table was closed")
        self.reader.check_live()
        if row_ids.device != self.device:
            raise ValueError(f"row ids on {row_ids.device}, the table is registered for {self.device}")
        flat = row_ids.reshape(-1)
        if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.dtype == torch.bool:
            # As on the host path: a cast would turn 1.7 into row 1 without a word.
            raise RowIdError(f"row ids must be integers, got {flat.dtype}")
        if flat.dtype not in (torch.int64, torch.int32):
            flat = flat.long()
        start = max(valid_start, 0)
        end = self.num_rows if valid_end is None else min(valid_end, self.num_rows)
        if start == 0 and end == self.num_rows:
            gathered = torch.index_select(words, 0, flat)
        else:
            owned = (flat >= start) & (flat < end)
            gathered = torch.index_select(words, 0, torch.where(owned, flat, 0))
            gathered.mul_(owned.unsqueeze(1))
        return gathered.view(torch.uint8).reshape(*row_ids.shape, self.row_bytes)

    def close(self) -> None:
        """Unpins the mapping; call before the reader unmaps it. Safe to call twice."""
        if self.address is None:
            return
        address, self.address = self.address, None
        try:
            # Kernels already queued may still read the rows: unpinning under them would
            # turn a stale read into an illegal-address fault.
            torch.cuda.synchronize(self.device)
        finally:
            self._words = self.rows = None
            try:
                self._driver.unregister(self._ordinal, address)
            except CudaRegistrationError as exc:
                logger.warning("could not unregister the PLE table mapping: %s", exc)


def host_registered(address: int, device: torch.device) -> bool:
    """Whether `address` lies in memory registered with the CUDA driver (for tests)."""
    assert device.index is not None
    return _driver().is_registered(device.index, address)


def driver_support(device: torch.device) -> dict[str, int]:
    """The driver facts this module relies on, for logs and benchmarks."""
    assert device.index is not None
    return _driver().facts(device.index)


class _CudaArray:
    """A bare `__cuda_array_interface__` exporter: torch wraps the pointer, no copy.
    torch keeps this object alive as long as any tensor view of it lives.

    The read-only flag is False because torch refuses True; the GPU still cannot write
    the rows (registered READ_ONLY), and nothing here writes them."""

    def __init__(self, pointer: int, shape: tuple[int, int], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (pointer, False), "version": 2, "strides": None}


class _Driver:
    """The few libcuda entry points this module needs."""

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaRegistrationError(f"cannot load the CUDA driver library: {exc}") from exc
        self._check("cuInit", self._lib.cuInit(0))
        self._contexts: dict[int, ctypes.c_void_p] = {}

    def facts(self, ordinal: int) -> dict[str, int]:
        version = ctypes.c_int()
        self._check("cuDriverGetVersion", self._lib.cuDriverGetVersion(ctypes.byref(version)))
        return {"driver_version": version.value,
                "can_use_host_pointer_for_registered_mem":
                    self._attribute(ordinal, _ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM),
                "read_only_host_register_supported":
                    self._attribute(ordinal, _ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED),
                "pageable_memory_access": self._attribute(ordinal, _ATTR_PAGEABLE_MEMORY_ACCESS)}

    def why_not_supported(self, ordinal: int) -> str | None:
        facts = self.facts(ordinal)
        if not facts["read_only_host_register_supported"]:
            return (f"the CUDA driver ({facts['driver_version']}) cannot register read-only "
                    f"memory on device {ordinal} (READ_ONLY_HOST_REGISTER_SUPPORTED = 0), and "
                    "the shared table is mapped read-only")
        if not facts["can_use_host_pointer_for_registered_mem"]:
            return (f"device {ordinal} cannot use host pointers of registered memory "
                    "(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 0, no UVA for it)")
        return None

    def register(self, ordinal: int, address: int, size: int, flags: int) -> None:
        with self._primary_context(ordinal):
            self._check(f"registering {size / 2**30:.2f} GiB of shared table at {address:#x} "
                        f"(cuMemHostRegister, flags {flags})",
                        self._lib.cuMemHostRegister_v2(ctypes.c_void_p(address),
                                                       ctypes.c_size_t(size), ctypes.c_uint(flags)))

    def unregister(self, ordinal: int, address: int) -> None:
        with self._primary_context(ordinal):
            self._check("cuMemHostUnregister", self._lib.cuMemHostUnregister(ctypes.c_void_p(address)))

    def is_registered(self, ordinal: int, address: int) -> bool:
        flags = ctypes.c_uint()
        with self._primary_context(ordinal):
            return self._lib.cuMemHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(address)) == 0

    def _attribute(self, ordinal: int, attribute: int) -> int:
        device = ctypes.c_int()
        value = ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(device), ordinal))
        self._check("cuDeviceGetAttribute",
                    self._lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device))
        return value.value

    @contextmanager
    def _primary_context(self, ordinal: int) -> Iterator[None]:
        """The device's primary context (the one torch uses) made current on this thread
        for the call: registration and unregistration may run on any thread.

        Retained once and never released. A registration lives only as long as its
        context, and before torch's first allocation nothing else holds the primary
        context: released after registering, it would be destroyed with the registration
        in it, while torch went on to wrap the dead pointer (seen on the H200)."""
        context = self._contexts.get(ordinal)
        if context is None:
            device = ctypes.c_int()
            context = ctypes.c_void_p()
            self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(device), ordinal))
            self._check("cuDevicePrimaryCtxRetain",
                        self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
            self._contexts[ordinal] = context
        self._check("cuCtxPushCurrent", self._lib.cuCtxPushCurrent_v2(context))
        try:
            yield
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def _check(self, what: str, result: int) -> None:
        if result != 0:
            message = ctypes.c_char_p()
            self._lib.cuGetErrorString(result, ctypes.byref(message))
            text = message.value.decode() if message.value else "unknown error"
            raise CudaRegistrationError(f"{what} failed: CUDA driver error {result} ({text})")


@cache
def _driver() -> _Driver:
    return _Driver()
