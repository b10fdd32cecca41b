"""Runs the PLE service: validate the file, listen, fill shared memory, serve, clean up on
SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

from services.mesh.errors import ServiceStartError
from services.mesh.grpc_server import GrpcServer
from services.mesh.service_names import PLE_GRPC
from services.ple_offload.errors import PleError, TableFileError
from services.ple_offload.servicer import PleOffloadServicer
from services.ple_offload.settings import PleSettings
from services.ple_offload.table_format import find_table
from services.ple_offload.table_loading_progress import LoadingProgress
from services.ple_offload.table_segment import TableSegment

logger = logging.getLogger(__name__)


async def serve(settings: PleSettings) -> None:
    """Serves one table until SIGTERM/SIGINT; the segment is removed on every exit path.
    Raises ServiceStartError, naming the cause, when the table cannot be served."""
    if settings.cpus:
        _run_on_cpus(settings.cpus)
    try:
        source = find_table(settings.table_path, settings.tensor_name, settings.expectation())
    except TableFileError as exc:
        raise ServiceStartError(str(exc)) from exc
    logger.info("table %s: %d rows x %d (%s), %.2f GiB, header sha256 %s", source.tensor_name,
                source.num_rows, source.row_width, source.dtype.name,
                source.table_bytes / 2**30, source.header_sha256.hex())
    segment = TableSegment(settings.shm_name, source, settings.shm_dir)
    server = GrpcServer(PLE_GRPC, settings.address, grace_s=settings.grace_s)
    servicer = PleOffloadServicer(segment)
    server.add(servicer.add_to_server)
    # Listening before the load, so a taken or wrong address fails now, not after minutes
    # of copying the table. Health says NOT_SERVING (grpc's default is SERVING) and
    # lookups answer UNAVAILABLE until the table is published.
    await server.set_serving(False)
    await server.start()
    # From here a signal must not kill the process before `finally` removes the segment:
    # until the server takes the signals over, they only ask the startup to stop.
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            # Reserving a table of tens of GiB takes seconds; the loop keeps taking signals.
            await asyncio.to_thread(segment.create)
            await _load(segment, settings.show_progress, stop)
        except InterruptedError:
            logger.info("stopped while loading the table")
            return
        except (PleError, OSError) as exc:  # a segment in use, no room, a file that shrank
            raise ServiceStartError(str(exc)) from exc
        segment.publish()
        if stop.is_set():
            server.request_stop()  # a signal came while the table was published

        async def close_for_readers() -> None:
            segment.close_for_readers()
            servicer.end_streams()

        await server.serve_until_signal(on_stop=close_for_readers)
    finally:
        await server.stop_now()  # stopped already, unless the startup failed
        segment.unmap()


def _run_on_cpus(cpus: list[int]) -> None:
    """Pins every thread of this process to `cpus`; threads started later inherit it. The
    threads that exist already (numpy's BLAS pool starts at import) are pinned one by one."""
    for thread_id in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread_id), cpus)
    logger.info("running on CPUs %s", sorted(cpus))


async def _load(segment: TableSegment, show_progress: bool, stop: threading.Event) -> None:
    """Copies the rows on a worker thread; `stop` (set by SIGTERM/SIGINT) cancels the copy,
    also when it is set before the copy starts."""
    with LoadingProgress(segment.source.table_bytes, enabled=show_progress) as progress:
        await asyncio.to_thread(segment.load, progress.advance, stop)
