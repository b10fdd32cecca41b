"""An engine service stand-in: sets grpc up as every `backport` command does, serves a gRPC
server, then starts a child the way vLLM starts its engine core (vLLM's own multiprocessing
context, after the engine's `spawn_vllm_processes_for_ple`), and in that child gathers PLE rows
over gRPC as the hook's client does there.

Run as `python -m tests.ple.vllm_process_probe ADDRESS TIMEOUT_S`; prints one JSON line: the
start method and either the SHA-256 of the rows of ids 0-1023 or the child's error; exits 3
when the child has not finished within TIMEOUT_S."""

from __future__ import annotations

from services.mesh.grpc_io import prefer_polling_thread_io

prefer_polling_thread_io()

import asyncio  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from multiprocessing.queues import Queue  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402


def gather_in_child(address: str, results: Queue) -> None:
    from services.ple_offload.client import PleTableClient

    try:
        client = PleTableClient(address, allow_shared_memory=False)
        rows = client.gather(np.arange(1024, dtype=np.int64).reshape(64, 16))
        client.close()
    except Exception as error:  # reported to the parent, which prints it
        results.put({"error": str(error)})
    else:
        results.put({"rows_sha256": hashlib.sha256(rows.tobytes()).hexdigest()})


def serve_in_background() -> None:
    serving = threading.Event()

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        serving.set()
        await asyncio.Event().wait()

    threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
    serving.wait()


def main() -> None:
    from vllm.utils.system_utils import get_mp_context

    from services.engine.vllm_engine import spawn_vllm_processes_for_ple

    serve_in_background()
    spawn_vllm_processes_for_ple()
    context = get_mp_context()
    results = context.Queue()
    child = context.Process(target=gather_in_child, args=(sys.argv[1], results), daemon=True)
    child.start()
    child.join(float(sys.argv[2]))
    if child.is_alive():
        child.kill()
        sys.exit(3)
    print(json.dumps({"start_method": context.get_start_method(), **results.get(timeout=5)}))


if __name__ == "__main__":
    main()
