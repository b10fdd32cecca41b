"""A second SIGTERM to a gRPC service that drains (the tokenizer service as a real process, over
real gRPC; the engine's drain runs through the same `GrpcServer`, for up to 60 s)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from backport.v1 import tokenizer_pb2 as pb
from services.tokenizer.client import TokenizerClient
from tests.cluster.processes import kill_group, start_tokenizer
from tests.conftest import free_port, wait_for_grpc_serving

START_TIMEOUT_S = 120.0
TOKENIZER_GRACE_S = 5.0  # services/tokenizer/server.py
STEP_INTERVAL_S = 0.1
# Time enough for the signal to reach the service and its stop to reach the stream.
CUT_SHORT_WITHIN_S = 2.0


def test_a_second_sigterm_during_the_drain_ends_it_at_once(embedded_model_path: Path,
                                                            tmp_path: Path) -> None:
    """The second signal was ignored: the stream was served on until the drain's grace ran
    out, as `backport up`'s second Ctrl-C, which it passes on to every service, is not."""
    port, log_path = free_port(), tmp_path / "tokenizer.log"
    process = start_tokenizer(embedded_model_path, port, log_path)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process, log_path)

        async def stream_through_two_sigterms() -> tuple[float, float]:
            """(when the first signal went, when the second did), the stream's end in between."""
            client = TokenizerClient(f"127.0.0.1:{port}")
            try:
                call = client.stub.Detokenize()
                await call.write(pb.DetokenizeRequest(token_ids=[504]))
                await call.read()
                process.terminate()
                first_at = time.monotonic()
                served_while_draining = await _step_until_ended(call, num_steps=5)
                assert served_while_draining, "the drain did not serve the open stream"
                process.terminate()
                second_at = time.monotonic()
                assert not await _step_until_ended(call, num_steps=None)
                return first_at, second_at
            finally:
                await client.close()

        first_at, second_at = asyncio.run(stream_through_two_sigterms())
        ended_at = time.monotonic()
        assert ended_at - second_at < CUT_SHORT_WITHIN_S, (
            f"served {ended_at - second_at:.1f} s after the second signal "
            f"(the grace ends {TOKENIZER_GRACE_S - (second_at - first_at):.1f} s after it)")
        assert process.wait(30) == 0
    finally:
        kill_group(process)
        process.wait()
    log = log_path.read_text(errors="replace")
    assert "Traceback" not in log and "ERROR" not in log, log


async def _step_until_ended(call: grpc.aio.StreamStreamCall, num_steps: int | None) -> bool:
    """Steps the stream `num_steps` times (None: until it ends); whether it is still open."""
    step = 0
    while num_steps is None or step < num_steps:
        try:
            await call.write(pb.DetokenizeRequest(token_ids=[504]))
            if await call.read() is grpc.aio.EOF:
                return False
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return False  # the stop cancelled the call
        step += 1
        await asyncio.sleep(STEP_INTERVAL_S)
    return True
