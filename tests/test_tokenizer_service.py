"""The tokenizer service as a real process over real gRPC: what a bad request gets back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tokenizer.client import TokenizerClient
from tests.cluster.processes import kill_group
from tests.conftest import REPO_ROOT, engine_environment, free_port

START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def tokenizer_address(embedded_model_path: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "tokenizer", "--model", str(embedded_model_path),
             "--port", str(port)], cwd=REPO_ROOT, env=engine_environment(), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        _wait_until_serving(address, process, log_path)
        yield address
    finally:
        kill_group(process)
        process.wait()


def _wait_until_serving(address: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"the tokenizer service did not serve in {START_TIMEOUT_S} s")


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
