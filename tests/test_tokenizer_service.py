"""The tokenizer service as a real process over real gRPC: what a bad request gets back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
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
