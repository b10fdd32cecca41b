"""The status of a response's output items when it does not complete: an item the response
ended while it was still being written is `incomplete` (OpenAI's item statuses are
`in_progress`, `completed`, `incomplete`), never left `in_progress` in a response that is over.

A stream is failed by freezing the shared mesh's tokenizer service (SIGSTOP) under a gateway
process of its own with a short tokenizer deadline; max_output_tokens makes one incomplete.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.cluster.processes import child_pid, gateway_over
from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
TOKENIZER_TIMEOUT_S = 2
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                               "properties": {"city": {"type": "string", "maxLength": 24}}}}
STORY = {"model": MODEL, "input": "Write a very long story about old GPUs.", "temperature": 0,
         "max_output_tokens": 1000}
FORCED_CALL = {"model": MODEL, "input": "What is the weather in Paris?", "temperature": 0,
               "max_output_tokens": 48, "tools": [WEATHER_TOOL],
               "tool_choice": {"type": "function", "name": "get_weather"}}
STREAM_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def deadline_gateway(mesh: RunningMesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gateway_over(mesh, tmp_path_factory.mktemp("deadline-gateway"),
                      env={"BACKPORT_GATEWAY_TOKENIZER_TIMEOUT_S": str(TOKENIZER_TIMEOUT_S)}) as base_url:
        yield base_url


def stream_failed_after(base_url: str, mesh: RunningMesh, body: dict[str, Any],
                        event_type: str) -> list[ResponseStreamEvent]:
    """The events of `body` streamed, its tokenizer service frozen once an `event_type` event
    came; each event validated strictly as OpenAI's types."""
    tokenizer_pid = child_pid(mesh.process.pid, "services.cli", "tokenizer")
    events: list[ResponseStreamEvent] = []
    with httpx.stream("POST", f"{base_url}/responses", json=body | {"stream": True},
                      timeout=60) as reply:
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(STREAM_EVENT.validate_json(line.removeprefix("data: ")))
                if events[-1].type == event_type:
                    break
        os.kill(tokenizer_pid, signal.SIGSTOP)
        try:
            events += [STREAM_EVENT.validate_json(line.removeprefix("data: "))
                       for line in lines if line.startswith("data: ")]
        finally:
            os.kill(tokenizer_pid, signal.SIGCONT)
    return events


@pytest.mark.parametrize(("body", "item_type", "freeze_after"), [
    (STORY, "message", "response.output_text.delta"),
    (FORCED_CALL, "function_call", "response.function_call_arguments.delta"),
])
def test_an_item_a_failed_stream_cut_short_ends_incomplete(
        deadline_gateway: str, mesh: RunningMesh, body: dict[str, Any], item_type: str,
        freeze_after: str) -> None:
    """Was `in_progress` in `response.failed`, with no `response.output_item.done`: a client
    could not tell the item would never be finished."""
    events = stream_failed_after(deadline_gateway, mesh, body, freeze_after)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"], events[-3:]
    failed = events[-1].response
    [item] = [item for item in failed.output if item.type == item_type]
    assert item.status == "incomplete"
    [done] = [e for e in events if e.type == "response.output_item.done"]
    assert done.item == item
    assert events.index(done) < len(events) - 2  # before the `error` event


def test_items_of_a_response_cut_by_max_output_tokens_end_incomplete(mesh: RunningMesh) -> None:
    """Non-streamed and streamed alike, for a message and a function call."""
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=60)
    for body, item_type in ((STORY | {"max_output_tokens": 4}, "message"),
                            (FORCED_CALL | {"max_output_tokens": 6}, "function_call")):
        whole = client.responses.create(**body)
        assert whole.status == "incomplete"
        assert [(item.type, item.status) for item in whole.output] == [(item_type, "incomplete")]
        events = list(client.responses.create(**body, stream=True))
        assert events[-1].type == "response.incomplete"
        assert [(item.type, item.status) for item in events[-1].response.output] == [
            (item_type, "incomplete")]
        assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
