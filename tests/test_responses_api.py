"""`POST /v1/responses` through the mesh on the embedded model, with the official openai client
and its stream helpers (the embedded model has no tool format: forced calls come from the
constrained output)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from services.engine.client import EngineClient
from tests.cluster.processes import gateway_over
from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
# The question of tests/test_mesh.py, asked the way whose first tokens are no near tie.
QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                               "properties": {"city": {"type": "string", "maxLength": 24}}}}
CITY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "big"],
               "properties": {"city": {"type": "string", "maxLength": 24}, "big": {"type": "boolean"}}}


STREAM_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def test_a_string_input_answers(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24,
                                       instructions="You are a helpful assistant.", metadata={"k": "v"})
    assert response.id.startswith("resp_") and response.object == "response"
    assert "Paris" in response.output_text
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].content[0].type == "output_text"
    assert response.usage.input_tokens > 10 and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == "You are a helpful assistant." and response.metadata == {"k": "v"}
    assert response.error is None
    assert response.created_at <= response.completed_at <= time.time()


def test_streamed_events_accumulate_to_the_non_streamed_output(client: openai.OpenAI) -> None:
    asked: dict[str, Any] = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 24}
    whole = client.responses.create(**asked)
    events = list(client.responses.create(**asked, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and events[-1].response.status == "completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    with client.responses.stream(**asked) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert snapshots[-1] == whole.output_text == final.output_text
    assert [item.type for item in final.output] == [item.type for item in whole.output]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_null_parallel_tool_calls_and_stream_mean_their_defaults(client: openai.OpenAI) -> None:
    """OpenAI's API takes null for both (the client sends it for None); was a 400."""
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=4,
                                       parallel_tool_calls=None, stream=None)
    assert response.status == "incomplete" and response.parallel_tool_calls is True


def test_unset_temperature_and_top_p_are_echoed_as_sampled_with(client: openai.OpenAI) -> None:
    """vLLM's 1.0 each, the embedded model setting no defaults of its own; they were null."""
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    assert (response.temperature, response.top_p) == (1.0, 1.0)


def test_max_output_tokens_makes_the_response_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=4)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 4
    assert response.output[0].status == "incomplete" and response.completed_at is None
    events = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                          max_output_tokens=4, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == response.output_text
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_named_function_choice_calls_it_and_streams_the_same_arguments(client: openai.OpenAI) -> None:
    asked: dict[str, Any] = {
        "model": MODEL, "input": "What is the weather in Paris?", "temperature": 0,
        "max_output_tokens": 48, "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"}}
    response = client.responses.create(**asked)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert calls[0].call_id.startswith("call_")
    assert set(json.loads(calls[0].arguments)) == {"city"}
    assert response.tool_choice.name == "get_weather"
    with client.responses.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    streamed_calls = [item for item in final.output if item.type == "function_call"]
    assert "".join(deltas) == streamed_calls[0].arguments == calls[0].arguments
    # OpenAI's spec requires the name on the done event; clients typed from it fail without.
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.model_dump().get("name"), done.arguments) == ("get_weather", calls[0].arguments)


def test_function_call_items_and_their_output_render_and_answer(client: openai.OpenAI) -> None:
    conversation: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should look it up."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 degrees."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "So, is it warm there?"}]}]
    response = client.responses.create(model=MODEL, input=conversation, tools=[WEATHER_TOOL],
                                       temperature=0, max_output_tokens=24)
    assert response.output_text.strip()
    assert response.usage.input_tokens > 30


def test_a_json_schema_text_format_gives_json_of_that_schema(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Name the capital of France and say if it is big.", temperature=0,
        max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}})
    answer = json.loads(response.output_text)
    assert set(answer) == {"city", "big"} and isinstance(answer["big"], bool)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("fields", [
    {"input": QUESTION},
    {"input": "What is the weather in Paris?", "tools": [WEATHER_TOOL], "tool_choice": "required",
     "max_output_tokens": 48},
])
def test_the_response_and_its_events_validate_as_the_client_types(mesh: RunningMesh,
                                                                  fields: dict[str, Any]) -> None:
    """Strictly: the client itself builds its models without validating, so a required field
    missing there only shows as None where a user reads an int."""
    body = {"model": MODEL, "temperature": 0, "max_output_tokens": 8} | fields
    whole = httpx.post(f"{mesh.base_url}/responses", json=body, timeout=60)
    Response.model_validate(whole.json())
    with httpx.stream("POST", f"{mesh.base_url}/responses", json=body | {"stream": True},
                      timeout=60) as reply:
        events = [STREAM_EVENT.validate_json(line.removeprefix("data: "))
                  for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.input_tokens_details.cache_write_tokens == 0


@pytest.mark.parametrize(("fields", "param", "problem"), [
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input", "unsupported item type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input", "input[0].call_id"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
     "input", "input[1]: no function_call item before it has call_id 'call_9'"),
    ({"input": None}, "input", "a string or a list of input items"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"previous_response_id": "resp_123"}, "previous_response_id", "not stored"),
    ({"conversation": {"id": "conv_123"}, "previous_response_id": "resp_123"}, "conversation",
     "cannot be given with previous_response_id"),
    ({"background": True, "store": False}, "background", "cannot have store: false"),
    ({"prompt": {"id": "pmpt_123"}}, "prompt", "stored prompts"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs",
     "less than or equal to 20"),
    ({"top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
    ({"include": ["reasoning.everything"]}, "include", "unknown value 'reasoning.everything'"),
    ({"truncation": "middle"}, "truncation", "'auto' or 'disabled'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice",
     "'get_time'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice", "got type 'allowed_tools'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function"}}, "tool_choice", "without a name"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a schema"),
    # Schemas only the engine's grammar compiler refuses.
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, "text", "wat"),
    ({"tools": [WEATHER_TOOL | {"parameters": {"type": "wat"}}], "tool_choice": "required"},
     "tools", "wat"),
    ({"max_output_tokens": 4000}, "max_output_tokens", "maximum context length"),
    # Was "cannot be combined with response_format": a field the client never wrote.
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "tool_choice", "tool_choice: cannot be combined with text"),
    # Only echoed back: the response could not be encoded.
    ({"metadata": {"k": "\ud800"}}, "metadata", "surrogate"),
    ({"metadata": {"k": "\ud800"}, "stream": True}, "metadata", "surrogate"),
])
def test_bad_inputs_are_400_naming_the_field(mesh: RunningMesh, fields: dict[str, Any], param: str,
                                             problem: str) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 2} | fields
    # ASCII JSON: a lone surrogate escaped, as a client's JSON encoder sends it.
    reply = httpx.post(f"{mesh.base_url}/responses", content=json.dumps(body),
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", reply.text
    assert param in error["message"] and problem in error["message"], reply.text


def test_a_response_its_engine_aborts_ends_cancelled_and_its_id_is_the_engine_requests(
        client: openai.OpenAI, mesh: RunningMesh) -> None:
    """An operator's `Abort` takes the id the client was given; the stream then ends with the
    output so far and status `cancelled` (vLLM's), on OpenAI's `response.incomplete` event."""
    stream = client.responses.create(model=MODEL, input="Count from 1 to 1000, one number a line.",
                                     temperature=0, max_output_tokens=1500, stream=True)
    events = [next(stream)]
    assert events[0].type == "response.created"
    asyncio.run(_abort(mesh.engine_address, events[0].response.id))
    events += list(stream)
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled", last
    assert last.response.usage.output_tokens < 1500
    assert all(item.status == "incomplete" for item in last.response.output
               if item.type == "message")


async def _abort(engine_address: str, request_id: str) -> None:
    engine = EngineClient(engine_address)
    try:
        await engine.abort(request_id)
    finally:
        await engine.close()


LOGPROBS = "message.output_text.logprobs"


def text_logprobs(response: Response) -> list[dict[str, Any]]:
    return [entry.model_dump() for item in response.output if item.type == "message"
            for part in item.content if part.type == "output_text" for entry in part.logprobs or []]


def streamed_logprobs(events: list[ResponseStreamEvent]) -> list[dict[str, Any]]:
    return [entry.model_dump() for event in events if event.type == "response.output_text.delta"
            for entry in event.logprobs]


def without_bytes(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output_text part's entries in the stream's shape, which has no `bytes`."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


def test_include_of_logprobs_gives_the_output_texts_as_chat_gives_them(client: openai.OpenAI) -> None:
    """vLLM's Responses logprobs: each token of the output (the EOS that ends it last) with its
    `top_logprobs` alternatives, the same as chat's for the same prompt; was a 400."""
    asked: dict[str, Any] = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 24}
    response = client.responses.create(**asked, include=[LOGPROBS], top_logprobs=2)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=24, logprobs=True, top_logprobs=2)
    assert response.status == "completed" and response.top_logprobs == 2
    entries = text_logprobs(response)
    assert entries == chat.choices[0].logprobs.model_dump()["content"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in entries)
    assert "".join(entry["token"] for entry in entries[:-1]) == response.output_text

    events = list(client.responses.create(**asked, include=[LOGPROBS], top_logprobs=2, stream=True))
    assert streamed_logprobs(events) == without_bytes(entries)
    assert text_logprobs(events[-1].response) == entries
    [part_done] = [e for e in events if e.type == "response.content_part.done"]
    assert [entry.model_dump() for entry in part_done.part.logprobs] == entries

    plain = client.responses.create(**asked, top_logprobs=2)
    assert text_logprobs(plain) == [] and plain.top_logprobs is None
    plain_events = list(client.responses.create(**asked, stream=True))
    assert streamed_logprobs(plain_events) == [] and text_logprobs(plain_events[-1].response) == []


def test_a_call_alone_has_no_logprobs_to_show(client: openai.OpenAI) -> None:
    """As in vLLM: logprobs belong to output text, and a forced call writes none."""
    asked: dict[str, Any] = {
        "model": MODEL, "input": "What is the weather in Paris?", "temperature": 0,
        "max_output_tokens": 48, "tools": [WEATHER_TOOL], "tool_choice": "required",
        "include": [LOGPROBS], "top_logprobs": 1}
    response = client.responses.create(**asked)
    assert [item.type for item in response.output] == ["function_call"]
    events = list(client.responses.create(**asked, stream=True))
    assert [item.type for item in events[-1].response.output] == ["function_call"]
    assert not [e for e in events if e.type.startswith("response.output_text")]


# A reasoning block the output opens itself, which a gateway with a reasoning parser reads as
# reasoning: the embedded model has no reasoning of its own.
REASONED = {"structured_outputs": {"regex": "<think>[a-z]{2,8}</think>Paris[.]"}}


@pytest.fixture(scope="module")
def reasoning_gateway(mesh: RunningMesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with gateway_over(mesh, tmp_path_factory.mktemp("reasoning-gateway"),
                      "--reasoning-parser", "qwen3") as base_url:
        yield openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_reasoning_tokens_logprobs_show_as_vllm_shows_them(reasoning_gateway: openai.OpenAI) -> None:
    """vLLM's: a whole response lists every token of the output on its message's text, the
    reasoning's too; a stream gives each text delta the tokens that wrote it, so its reasoning
    shows none. With `include_reasoning: false` neither shows any, as they would spell it out."""
    asked: dict[str, Any] = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 24,
                             "include": [LOGPROBS], "extra_body": REASONED}
    response = reasoning_gateway.responses.create(**asked)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == "Paris."
    reasoning = response.output[0].content[0].text
    tokens = "".join(entry["token"] for entry in text_logprobs(response))
    assert tokens.startswith(f"<think>{reasoning}</think>Paris.")

    events = list(reasoning_gateway.responses.create(**asked, stream=True))
    streamed = "".join(entry["token"] for entry in streamed_logprobs(events))
    assert tokens.endswith(streamed) and "Paris." in streamed
    assert tokens.removesuffix(streamed).startswith(f"<think>{reasoning}")
    assert "".join(e["token"] for e in text_logprobs(events[-1].response)) == streamed

    hidden = {**asked, "extra_body": REASONED | {"include_reasoning": False}}
    response = reasoning_gateway.responses.create(**hidden)
    assert response.output_text == "Paris." and text_logprobs(response) == []
    events = list(reasoning_gateway.responses.create(**hidden, stream=True))
    assert streamed_logprobs(events) == [] and text_logprobs(events[-1].response) == []


def test_truncation_auto_drops_the_fewest_leading_items_that_leave_room_for_the_output(
        client: openai.OpenAI, mesh: RunningMesh) -> None:
    """Twelve turns of about 200 tokens and 300 output tokens do not fit the mesh's 2,048-token
    context: refused whole, answered with the fewest first turns dropped, the instructions kept
    (counted by /tokenize for each cut)."""
    max_model_len, wanted = 2048, 300
    turns = [{"role": "user" if index % 2 == 0 else "assistant",
              "content": f"Turn {index}: " + "tell me more " * 66} for index in range(12)]
    fields: dict[str, Any] = dict(model=MODEL, instructions="Be brief.", input=turns,
                                  max_output_tokens=wanted)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**fields)
    assert refused.value.body["param"] == "input"

    def prompt_tokens(num_dropped: int) -> int:
        messages = [{"role": "system", "content": "Be brief."}, *turns[num_dropped:]]
        reply = httpx.post(f"{mesh.base_url.removesuffix('/v1')}/tokenize", timeout=60,
                           json={"model": MODEL, "messages": messages, "add_generation_prompt": True})
        return reply.json()["count"]

    fewest = next(count for count in range(12) if prompt_tokens(count) + wanted <= max_model_len)
    assert fewest >= 2
    # vLLM's `stop`: the output's length is not what is tested.
    truncated = client.responses.create(**fields, truncation="auto", extra_body={"stop": ["."]})
    assert truncated.truncation == "auto" and truncated.status in ("completed", "incomplete")
    assert truncated.usage.input_tokens == prompt_tokens(fewest)


def test_input_tokens_counts_what_a_response_is_given(client: openai.OpenAI) -> None:
    """`responses.input_tokens.count` against the input tokens of the responses themselves:
    instructions and tools, a previous response's history, truncation, a model left out."""
    asked: dict[str, Any] = dict(model=MODEL, input=QUESTION, instructions="Be brief.",
                                 tools=[WEATHER_TOOL], tool_choice="none")
    first = client.responses.create(**asked, max_output_tokens=4)
    counted = client.responses.input_tokens.count(**asked)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == first.usage.input_tokens
    bare = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1)
    assert client.responses.input_tokens.count(input=QUESTION).input_tokens == bare.usage.input_tokens

    follow_up: dict[str, Any] = dict(model=MODEL, input="And of Spain?",
                                     previous_response_id=first.id)
    second = client.responses.create(**follow_up, max_output_tokens=4)
    assert (client.responses.input_tokens.count(**follow_up).input_tokens
            == second.usage.input_tokens > first.usage.input_tokens)


def test_input_tokens_counts_past_the_context_and_after_truncation(client: openai.OpenAI) -> None:
    """Past the mesh's 2,048-token context a response is a 400; its count is still given, and
    with `truncation: "auto"` the count is what is left."""
    turns = [{"role": "user", "content": f"Turn {index}: " + "tell me more " * 66}
             for index in range(12)]
    whole = client.responses.input_tokens.count(model=MODEL, input=turns).input_tokens
    assert whole > 2048
    truncated = client.responses.input_tokens.count(model=MODEL, input=turns, truncation="auto")
    assert truncated.input_tokens < 2048
    answered = client.responses.create(model=MODEL, input=turns, truncation="auto",
                                       max_output_tokens=1)
    assert answered.usage.input_tokens == truncated.input_tokens


@pytest.mark.parametrize(("fields", "param", "error"), [
    ({"model": "no-such-model", "input": "hi"}, "model", openai.NotFoundError),
    ({"model": MODEL}, "input", openai.BadRequestError),
    ({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input", openai.BadRequestError),
    ({"model": MODEL, "input": "hi", "previous_response_id": "resp_none"}, "previous_response_id",
     openai.BadRequestError),
    ({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}, "tools",
     openai.BadRequestError),
])
def test_input_tokens_refuses_what_a_response_would(client: openai.OpenAI, fields: dict[str, Any],
                                                    param: str, error: type[Exception]) -> None:
    with pytest.raises(error) as refused:
        client.responses.input_tokens.count(**fields)
    assert refused.value.body["param"] == param, refused.value.body
