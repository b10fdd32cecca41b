"""`priority` (vLLM's) under `backport up --scheduling-policy priority`: an engine that runs one
sequence at a time serves its waiting requests lower priority value first, whichever endpoint
they came by. Real mesh, real vLLM scheduler, the official openai client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import openai
import pytest

from services.engine.client import EngineClient
from tests.conftest import RunningMesh, start_mesh, stop_mesh

MODEL = "SmolLM2-135M-Instruct-bf16"
QUEUE_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def priority_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMesh]:
    running = start_mesh(tmp_path_factory.mktemp("priority-mesh"), "--scheduling-policy", "priority",
                         "--max-num-seqs", "1", "--max-model-len", "1024",
                         "--kv-cache-memory-gib", "0.5")
    yield running
    stop_mesh(running)


def _async_client(mesh: RunningMesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


Send = Callable[[openai.AsyncOpenAI, int], Awaitable[Any]]
SHORT_REQUESTS: dict[str, Send] = {
    "chat": lambda client, priority: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        extra_body={"priority": priority}),
    "completions": lambda client, priority: client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, extra_body={"priority": priority}),
    "responses": lambda client, priority: client.responses.create(
        model=MODEL, input="Hello", max_output_tokens=4, extra_body={"priority": priority}),
    # vLLM's header, which takes the body's place.
    "header": lambda client, priority: client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, extra_body={"priority": -priority},
        extra_headers={"X-Vllm-Priority": str(priority)}),
}


async def _wait_for_waiting(engine: EngineClient, count: int) -> None:
    deadline = time.monotonic() + QUEUE_TIMEOUT_S
    # A generous deadline: the openai client's first call of a kind imports its types, holding
    # this event loop for seconds on a busy 2-core machine.
    while (await engine.loads(timeout_s=QUEUE_TIMEOUT_S)).num_waiting < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine never had {count} request(s) waiting")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("endpoint", SHORT_REQUESTS)
def test_of_two_waiting_requests_the_lower_priority_value_is_served_first(
        priority_mesh: RunningMesh, endpoint: str) -> None:
    """The later request, of priority -1, runs before the earlier one, of priority 1: first come
    first served (or a priority dropped on the way) serves them the other way round."""
    send = SHORT_REQUESTS[endpoint]

    async def finishing_order() -> list[str]:
        client, engine = _async_client(priority_mesh), EngineClient(priority_mesh.engine_address)
        finished: list[str] = []

        async def run(name: str, priority: int) -> None:
            await send(client, priority)
            finished.append(name)

        try:
            # Holds the engine's one seat until closed.
            seat = await client.completions.create(model=MODEL, prompt="Once upon a time",
                                                   max_tokens=900, stream=True,
                                                   extra_body={"ignore_eos": True})
            await anext(aiter(seat))
            earlier = asyncio.create_task(run("earlier", 1))
            await _wait_for_waiting(engine, 1)
            later = asyncio.create_task(run("later", -1))
            await _wait_for_waiting(engine, 2)
            await seat.close()
            await asyncio.gather(earlier, later)
            return finished
        finally:
            await engine.close()
            await client.close()

    assert asyncio.run(finishing_order()) == ["later", "earlier"]


@pytest.mark.parametrize("priority", ["high", 2**63, 1.5, None])
def test_a_priority_that_is_not_a_64_bit_whole_number_is_refused_naming_the_field(
        priority_mesh: RunningMesh, priority: Any) -> None:
    client = openai.OpenAI(base_url=priority_mesh.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1,
                                  extra_body={"priority": priority})
    assert caught.value.body["param"] == "priority"


@pytest.mark.parametrize("header", ["high", "1.5", str(2**63)])
def test_a_priority_header_that_is_not_a_64_bit_whole_number_is_refused(
        priority_mesh: RunningMesh, header: str) -> None:
    """vLLM ignores it; a client that meant it would never learn why nothing changed."""
    client = openai.OpenAI(base_url=priority_mesh.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1, extra_headers={"X-Vllm-Priority": header})
    assert caught.value.body["param"] == "X-Vllm-Priority"
