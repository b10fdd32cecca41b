"""Structured outputs through the mesh: `response_format`, vLLM's `structured_outputs`, and
forced tool choices, on the embedded model (whose chat template has no tool format: forced
calls come from the constrained output alone)."""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
ASK_CITY = [{"role": "user", "content": "Name the capital of France and say if it is big."}]
CITY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "big"],
               "properties": {"city": {"type": "string", "maxLength": 24},
                              "big": {"type": "boolean"}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 24}}}}}
# A required parameter: with an empty object to fill, the model wrote newlines inside it until
# the token limit (greedy, on an AMD EPYC host's bf16; vLLM's JSON grammar allows any whitespace).
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["timezone"],
                                       "properties": {"timezone": {"type": "string", "maxLength": 32}}}}}


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def test_json_schema_response_format_gives_an_object_of_that_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, temperature=0, max_tokens=64,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    answer = json.loads(reply.choices[0].message.content)
    assert set(answer) == {"city", "big"}
    assert isinstance(answer["city"], str) and len(answer["city"]) <= 24
    assert isinstance(answer["big"], bool)


def test_json_object_response_format_gives_an_object(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:",
                                      temperature=0, max_tokens=96,
                                      extra_body={"response_format": {"type": "json_object"}})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert reply.choices[0].text.lstrip().startswith("{")


def test_vllm_choice_and_regex_constraints(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, temperature=0, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}})
    assert choice.choices[0].message.content in {"Paris", "Lyon", "Nice"}
    digits = client.completions.create(model=MODEL, prompt="Three digits:", temperature=0.8, seed=3,
                                       max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text)


def test_a_named_tool_choice_calls_that_tool_and_streams_the_same_call(client: openai.OpenAI) -> None:
    """The call ends with finish_reason "stop", streamed or not: OpenAI's and vLLM's answer for
    a call the request named ("tool_calls" is for calls the model chose or was required to make)."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=48, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice=choice)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert set(json.loads(message.tool_calls[0].function.arguments)) == {"city"}
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=48, tools=[WEATHER_TOOL, TIME_TOOL],
                                            tool_choice=choice, stream=True)
    arguments, names, finish = [], [], None
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            names.append(call.function.name)
            arguments.append(call.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert [n for n in names if n] == ["get_weather"] and finish == "stop"
    assert "".join(arguments) == message.tool_calls[0].function.arguments


def test_required_tool_choice_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        temperature=0, max_tokens=96, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
        parallel_tool_calls=False)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    arguments = json.loads(calls[0].function.arguments)
    assert (calls[0].function.name, sorted(arguments)) in [("get_weather", ["city"]),
                                                            ("get_time", ["timezone"])]


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_cut_by_the_token_limit_show_no_json(client: openai.OpenAI,
                                                            stream: bool) -> None:
    """Four tokens are not a call: the choice ends `length` with neither a call nor the start of
    the calls' JSON array as its text (it was `[  \n{`)."""
    asked: dict[str, Any] = dict(model=MODEL, temperature=0, max_tokens=4, tools=[WEATHER_TOOL],
                                 messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                 tool_choice="required")
    if stream:
        chunks = list(client.chat.completions.create(**asked, stream=True))
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        assert not any(delta.content or delta.tool_calls for delta in deltas)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        choice = client.chat.completions.create(**asked).choices[0]
        assert choice.finish_reason == "length"
        assert not choice.message.content and not choice.message.tool_calls


def test_the_sdk_stream_helper_ends_every_required_call(client: openai.OpenAI) -> None:
    """`chat.completions.stream` fires `tool_calls.function.arguments.done` for a call only on a
    chunk after the call's last: required calls, released as the choice ends, came in the
    finishing chunk, and the helper never ended them."""
    with client.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Weather and time in Oslo?"}],
            temperature=0, max_tokens=160, tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice="required") as stream:
        done = [(event.name, event.arguments) for event in stream
                if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    calls = final.choices[0].message.tool_calls
    assert calls and done == [(c.function.name, c.function.arguments) for c in calls]


# Each: the request field, a constraint in it that the engine cannot compile, and what the
# error says is wrong.
UNCOMPILABLE_CONSTRAINTS = {
    "response_format schema of no type": (
        "response_format", {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
        "invalid JSON schema"),
    "structured_outputs schema of bad properties": (
        "structured_outputs", {"json": {"type": "object", "properties": 5}}, "invalid JSON schema"),
    "structured_outputs regex": ("structured_outputs", {"regex": "("}, "invalid regex"),
    "structured_outputs grammar": ("structured_outputs", {"grammar": "root ::= ("}, "invalid grammar"),
}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("case", UNCOMPILABLE_CONSTRAINTS)
def test_a_constraint_the_engine_cannot_compile_is_400_naming_its_field(
        client: openai.OpenAI, endpoint: str, case: str) -> None:
    param, constraint, problem = UNCOMPILABLE_CONSTRAINTS[case]
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=4,
                                           extra_body={param: constraint})
        else:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                      extra_body={param: constraint})
    assert caught.value.body["param"] == param
    assert caught.value.body["message"].startswith(f"{param}: {problem}: "), caught.value.body


def test_a_streamed_request_with_a_constraint_the_engine_cannot_compile_is_400(
        client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=4, stream=True,
                                       extra_body={"structured_outputs": {"regex": "("}})
    assert caught.value.body["param"] == "structured_outputs"
    assert client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=2).choices


def test_an_engine_error_beside_a_constraint_is_not_the_constraints(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=4,
                                       response_format={"type": "json_object"},
                                       extra_body={"min_tokens": 10})
    assert caught.value.body["param"] != "response_format"
    assert caught.value.body["message"].startswith("min_tokens"), caught.value.body


def test_two_constraints_at_once_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ASK_CITY, max_tokens=4, response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"regex": "a+"}})
    assert caught.value.body["param"] == "structured_outputs"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "bad"}}])
def test_a_forced_call_of_a_tool_whose_parameters_cannot_compile_is_400_naming_tools(
        client: openai.OpenAI, tool_choice: Any) -> None:
    """The schema is the tools' own: it named `tool_choice`, which the client had right."""
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=4, tools=[bad],
                                       tool_choice=tool_choice)
    assert caught.value.body["param"] == "tools"
    assert caught.value.body["message"].startswith("tools: invalid JSON schema: "), caught.value.body
