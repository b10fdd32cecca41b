"""The tokenizer service as a real process over real gRPC: what a bad request gets back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from services.tokenizer.client import TokenizerClient
from tests.cluster.processes import kill_group, start_tokenizer
from tests.conftest import free_port, wait_for_grpc_serving

START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def tokenizer_address(embedded_model_path: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.log"
    process = start_tokenizer(embedded_model_path, port, log_path)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process, log_path)
        yield f"127.0.0.1:{port}"
    finally:
        kill_group(process)
        process.wait()


def render_error(address: str, template_kwargs: dict[str, object]) -> grpc.aio.AioRpcError:
    async def render() -> grpc.aio.AioRpcError:
        client = TokenizerClient(address)
        try:
            await client.render_chat([{"role": "user", "content": "Hi"}], None, template_kwargs,
                                     add_generation_prompt=True, continue_final_message=False)
        except grpc.aio.AioRpcError as error:
            return error
        finally:
            await client.close()
        raise AssertionError("the render succeeded")

    return asyncio.run(render())


def test_template_kwarg_of_the_wrong_type_is_invalid_argument(tokenizer_address: str) -> None:
    # `documents` reaches apply_chat_template, which iterates it: a number fails there with a
    # TypeError, the request's fault, which used to come back as UNKNOWN.
    error = render_error(tokenizer_address, {"documents": 5})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith("messages: the model's chat template failed on the request")
    assert "TypeError" in error.details()


def test_the_service_still_renders_after_a_rejected_request(tokenizer_address: str) -> None:
    render_error(tokenizer_address, {"documents": 5})

    async def render() -> list[int]:
        client = TokenizerClient(tokenizer_address)
        try:
            reply = await client.render_chat([{"role": "user", "content": "Hi"}], None, {},
                                             add_generation_prompt=True,
                                             continue_final_message=False)
            return list(reply.token_ids)
        finally:
            await client.close()

    assert len(asyncio.run(render())) > 3



LONG_TOKEN_IDS = [1_000 + i % 40_000 for i in range(2_000_000)]
LONG_TEXT = " ".join(f"word{i} of a long prompt" for i in range(60_000))


async def decode_long(client: TokenizerClient) -> int:
    return len(await client.decode(LONG_TOKEN_IDS, skip_special_tokens=True))


async def encode_long(client: TokenizerClient) -> int:
    return len(await client.encode(LONG_TEXT, add_special_tokens=False))


@pytest.mark.parametrize("long_call", [decode_long, encode_long])
def test_a_long_call_leaves_other_streams_answered(
        tokenizer_address: str, long_call: Callable[[TokenizerClient], Awaitable[int]]) -> None:
    # Each long call takes the service over half a second. The tokenizers library held the GIL
    # through it, on the event loop or on a worker thread alike, and so held every other call
    # that long: a streaming request's detokenize steps too.
    async def count_steps_during_a_long_call() -> int:
        client = TokenizerClient(tokenizer_address)
        stream = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
        try:
            await stream.step([1_000])
            long_call_done = asyncio.ensure_future(long_call(client))
            # Past the time the service takes to receive and parse the request.
            await asyncio.sleep(0.2)
            num_steps = 0
            while not long_call_done.done():
                await stream.step([1_000])
                num_steps += 1
            assert await long_call_done > 100_000
            return num_steps
        finally:
            await stream.close()
            await client.close()

    # A step takes about a millisecond; one held behind the long call would end it.
    assert asyncio.run(count_steps_during_a_long_call()) >= 10


def test_logprob_texts_of_characters_split_across_tokens_join_up_to_the_text(
        tokenizer_address: str) -> None:
    # Byte-level tokens each holding part of a character decode alone to U+FFFD; in context,
    # the token completing a character shows all of it and the ones before it nothing.
    text = "東京は日本の首都です"

    async def texts() -> tuple[list[str], list[list[str]]]:
        client = TokenizerClient(tokenizer_address)
        try:
            ids = await client.encode(text, add_special_tokens=False)
            positions = [(ids[max(0, k - 4):k], [token_id]) for k, token_id in enumerate(ids)]
            return await client.token_texts(ids), await client.logprob_token_texts(positions)
        finally:
            await client.close()

    alone, in_context = asyncio.run(texts())
    assert sum(t.endswith("\ufffd") for t in alone) > len(text) / 2
    assert "".join(candidates[0] for candidates in in_context) == text
    assert all(not t.endswith("\ufffd") for [t] in in_context)
