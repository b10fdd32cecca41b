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
# The client's deadline, which bounds how long a step waits for the service to come back.
GONE_FOR_GOOD_TIMEOUT_S = 3.0
# Byte-level BPE splits these characters over several tokens: a step can end inside one, its
# bytes held in the service until the character completes.
TEXT = "The capital of France is Paris 🦜🧭 and the café serves 蘑菇 soup."


def test_a_step_after_the_service_went_away_for_good_is_an_unavailable_grpc_error(
        embedded_model_path: Path, tmp_path: Path) -> None:
    """The gateway turns a tokenizer `AioRpcError` into an error event naming the tokenizer
    service; the stream's own `asyncio.InvalidStateError` ("RPC already finished") was none it
    handles. Between two steps is where a stream spends most of its time: the engine's tokens
    come tens of milliseconds apart. The step tries new streams until the client's deadline."""
    port, log_path = free_port(), tmp_path / "tokenizer.log"
    process = start_tokenizer(embedded_model_path, port, log_path)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process, log_path)

        async def step_across_the_service_going_away() -> grpc.aio.AioRpcError:
            client = TokenizerClient(f"127.0.0.1:{port}", timeout_s=GONE_FOR_GOOD_TIMEOUT_S)
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


def test_a_sequence_goes_on_where_it_stopped_across_a_restart_of_the_service(
        embedded_model_path: Path, tmp_path: Path) -> None:
    """The launcher restarts a tokenizer service that exits. A stream open through the restart
    goes on with the same text an unbroken one makes, even when the restart falls inside a
    character whose bytes span tokens."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    processes = [start_tokenizer(embedded_model_path, port, tmp_path / "tokenizer-1.log")]
    try:
        wait_for_grpc_serving(address, START_TIMEOUT_S, processes[0], tmp_path / "tokenizer-1.log")

        async def step_across_a_restart() -> tuple[str, list[str], int]:
            client = TokenizerClient(address, timeout_s=START_TIMEOUT_S)
            try:
                token_ids = await client.encode(TEXT, add_special_tokens=False)
                prompt, generated = token_ids[:3], token_ids[3:]
                unbroken = await client.detokenizer(
                    skip_special_tokens=True, prompt_token_ids=prompt).step_each(generated)
                # The restart falls right after the first token that completes no character.
                cut = unbroken.index("") + 1
                detokenizer = client.detokenizer(skip_special_tokens=True, prompt_token_ids=prompt)
                texts = [await detokenizer.step([token_id]) for token_id in generated[:cut]]
                kill_group(processes[0])
                processes[0].wait()
                await asyncio.sleep(RESET_REACHES_CLIENT_S)
                processes.append(start_tokenizer(embedded_model_path, port,
                                                 tmp_path / "tokenizer-2.log"))
                # Sent while the new service is still starting.
                texts.append(await detokenizer.step(generated[cut:]))
                detokenizer.close()
                return "".join(unbroken), texts, cut
            finally:
                await client.close()

        unbroken, texts, cut = asyncio.run(step_across_a_restart())
        assert texts[cut - 1] == "", texts  # the cut is inside a character
        assert "".join(texts) == unbroken
        assert unbroken == " France is Paris 🦜🧭 and the café serves 蘑菇 soup."
    finally:
        for process in processes:
            kill_group(process)
            process.wait()
