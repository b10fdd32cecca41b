"""The tokenizer client's detokenize stream against a real tokenizer service process that goes
away mid-generation: what the caller (the gateway) gets back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.tokenizer.client import TokenizerClient
from tests.cluster.processes import kill_group, start_tokenizer
from tests.conftest import free_port, wait_for_grpc_serving

START_TIMEOUT_S = 120.0
# Long enough for the connection's reset to end the open stream on the client's side.
RESET_REACHES_CLIENT_S = 1.0


def test_a_step_after_the_service_went_away_between_steps_is_an_unavailable_grpc_error(
        embedded_model_path: Path, tmp_path: Path) -> None:
    """The gateway turns a tokenizer `AioRpcError` into an error event naming the tokenizer
    service; the stream's own `asyncio.InvalidStateError` ("RPC already finished") was none it
    handles. Between two steps is where a stream spends most of its time: the engine's tokens
    come tens of milliseconds apart."""
    port, log_path = free_port(), tmp_path / "tokenizer.log"
    process = start_tokenizer(embedded_model_path, port, log_path)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process, log_path)

        async def step_across_the_service_going_away() -> grpc.aio.AioRpcError:
            client = TokenizerClient(f"127.0.0.1:{port}", timeout_s=5.0)
            try:
                token_ids = await client.encode("The capital of France is Paris",
                                                add_special_tokens=False)
                detokenizer = client.detokenizer(skip_special_tokens=True,
                                                 prompt_token_ids=token_ids[:3])
                assert await detokenizer.step(token_ids[3:5]) == " France is"
                kill_group(process)
                process.wait()
                await asyncio.sleep(RESET_REACHES_CLIENT_S)
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    await detokenizer.step(token_ids[5:])
                detokenizer.close()
                return failure.value
            finally:
                await client.close()

        error = asyncio.run(step_across_the_service_going_away())
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        kill_group(process)
        process.wait()
