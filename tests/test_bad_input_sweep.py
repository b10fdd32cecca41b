"""Bad input on every POST endpoint: a 4xx in OpenAI's error shape naming the field, never a 500,
a hang or a 200 that drops what the client asked. Real `backport up` (the shared mesh), raw HTTP,
so a body can hold what a client library would not send. No case here reaches the engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import RunningMesh

ERROR_FIELDS = {"message", "type", "param", "code"}
MODEL = "SmolLM2-135M-Instruct-bf16"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 1}
GENERATING = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/responses": RESPONSE}


def post(mesh: RunningMesh, path: str, body: bytes | dict[str, Any] | list[Any],
         content_type: str = "application/json") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    # A short timeout: a refusal must come at once, not after a generation or a hang.
    return httpx.post(f"{mesh.base_url.removesuffix('/v1')}{path}", content=content,
                      headers={"content-type": content_type}, timeout=30)


def openai_error(reply: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    error = reply.json()["error"]
    assert set(error) == ERROR_FIELDS, error
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    return error


def with_fields(path: str, **fields: Any) -> dict[str, Any]:
    return GENERATING[path] | fields


# Defects found by the sweep, each failing before its fix.

@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/chat/completions", {"stop": 1}, "stop"),
    ("/v1/chat/completions", {"stop": [1, 2]}, "stop"),
    ("/v1/completions", {"stop": {"a": 1}}, "stop"),
    ("/v1/chat/completions", {"tool_choice": 1}, "tool_choice"),
    ("/v1/chat/completions", {"thinking": "x"}, "thinking"),
])
def test_a_union_field_of_the_wrong_type_is_named_without_its_member_types(
        mesh: RunningMesh, path: str, fields: dict[str, Any], param: str) -> None:
    """Was `param: "stop.str"`, `"tool_choice.str"`, `"thinking.bool"`: pydantic's name for the
    union member it tried first, not a field the client wrote."""
    error = openai_error(post(mesh, path, with_fields(path, **fields)))
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: "), error


def test_a_responses_content_part_of_an_unknown_type_names_no_schema_class(mesh: RunningMesh) -> None:
    """Was `input[0].content[0].TextPart.type: ...`: a class name of the gateway's in the message."""
    body = with_fields("/v1/responses", input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}])
    error = openai_error(post(mesh, "/v1/responses", body))
    assert error["param"] == "input"
    assert error["message"].startswith("input[0].content[0].type: "), error


@pytest.mark.parametrize("path", sorted(GENERATING))
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_non_finite_number_is_refused_as_such(mesh: RunningMesh, path: str, literal: str) -> None:
    """Python's JSON reads NaN, Infinity and 1e999; the refusal said "should be less than or equal
    to 2" for a NaN temperature, sending the client after the wrong problem."""
    body = json.dumps(with_fields(path, temperature=0)).replace('"temperature": 0',
                                                                 f'"temperature": {literal}')
    error = openai_error(post(mesh, path, body.encode()))
    assert error["param"] == "temperature"
    assert "finite" in error["message"], error


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/chat/completions", {"repetition_penalty": 1e308}, "repetition_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 1e-50}, "repetition_penalty"),
    ("/v1/completions", {"top_p": -1e-50}, "top_p"),
    ("/v1/responses", {"top_p": 1.0000001}, "top_p"),
])
def test_a_number_past_the_engines_float_is_refused_by_name(
        mesh: RunningMesh, path: str, fields: dict[str, Any], param: str) -> None:
    """Was a 400 from the engine with no param, saying "got inf" of the 1e308 the client sent, or
    "got 0.0" of its 1e-50: the engine protocol's 32-bit float overflowed or underflowed."""
    error = openai_error(post(mesh, path, with_fields(path, **fields)))
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: "), error


@pytest.mark.parametrize("metadata", [{f"k{index}": "v" for index in range(17)}, {"k": "v" * 513},
                                      {"k" * 65: "v"}])
def test_a_response_s_metadata_past_openai_s_limits_is_refused(
        mesh: RunningMesh, metadata: dict[str, str]) -> None:
    """Was taken whole, where OpenAI's API and this server's own conversations refuse it."""
    error = openai_error(post(mesh, "/v1/responses", with_fields("/v1/responses", metadata=metadata)))
    assert error["param"] == "metadata"


@pytest.mark.parametrize(("fields", "param", "instead"), [
    ({"functions": [{"name": "get_weather", "parameters": {"type": "object"}}]}, "functions",
     "give them as `tools`"),
    ({"function_call": {"name": "get_weather"}}, "function_call", "use `tool_choice`"),
    ({"function_call": "auto"}, "function_call", "use `tool_choice`"),
])
def test_openai_s_legacy_functions_are_refused_not_ignored(
        mesh: RunningMesh, fields: dict[str, Any], param: str, instead: str) -> None:
    """Ignored, as vLLM ignores them, the model answered in text without the functions it was
    given and the client waited for a `function_call` that could not come."""
    error = openai_error(post(mesh, "/v1/chat/completions", with_fields("/v1/chat/completions",
                                                                        **fields)))
    assert error["param"] == param
    assert error["message"] == f"{param}: is not supported by this server; {instead}", error


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/chat/completions", {"min_tokens": 2**32 - 1, "max_tokens": None}),
    ("/v1/chat/completions", {"min_tokens": 2048, "max_tokens": 2048}),
    ("/v1/completions", {"min_tokens": 2048, "max_tokens": 2048}),
])
def test_min_tokens_past_the_room_the_prompt_leaves_is_refused_by_name(
        mesh: RunningMesh, path: str, fields: dict[str, Any]) -> None:
    """Was a 400 from the engine with no param, naming a max_tokens the client never sent (the
    limit cut to the context's room)."""
    error = openai_error(post(mesh, path, with_fields(path, **fields)))
    assert error["param"] == "min_tokens" and error["code"] == "context_length_exceeded"
    assert "min_tokens" in error["message"], error


def test_a_logit_bias_key_of_non_ascii_digits_is_refused_as_not_a_token_id(mesh: RunningMesh) -> None:
    """Was "invalid literal for int() with base 10": `str.isdigit` takes "²"."""
    error = openai_error(post(mesh, "/v1/chat/completions",
                              with_fields("/v1/chat/completions", logit_bias={"\u00b2": 1})))
    assert error["param"] == "logit_bias" and "token ids" in error["message"], error


@pytest.mark.parametrize(("body", "problem"), [
    (b'{"model": "m", "prompt": "h\xff\xfei"}', "UTF-8"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nested"),
    (b"", "JSON object"),
    (b"null", "JSON object"),
])
def test_a_body_that_cannot_be_read_says_why(mesh: RunningMesh, body: bytes, problem: str) -> None:
    """Was "There was an error parsing the body" (bad UTF-8, nesting past Python's recursion
    limit) and "body: Field required" (no body): nothing the client could act on."""
    error = openai_error(post(mesh, "/v1/completions", body))
    assert error["message"].startswith("body: ") and problem in error["message"], error


# The sweep: representative bad inputs, each refused by name before any generation starts.

SWEEP: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"n": 1.5}, "n"),
    ("/v1/chat/completions", {"n": 2**64}, "n"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"top_p": [1]}, "top_p"),
    ("/v1/chat/completions", {"max_tokens": -5}, "max_tokens"),
    ("/v1/chat/completions", {"max_tokens": 100_000}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 2**64}, "max_completion_tokens"),
    ("/v1/chat/completions", {"seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"stop": ["x"] * 100}, "stop"),
    ("/v1/chat/completions", {"stream": {"a": 1}}, "stream"),
    ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"1": 1000}}, "logit_bias"),
    ("/v1/chat/completions", {"top_logprobs": 5}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 5}, "logprobs"),
    ("/v1/chat/completions", {"user": {"a": 1}}, "user"),
    ("/v1/chat/completions", {"model": ["m"]}, "model"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages"),
    ("/v1/chat/completions", {"tools": {"a": 1}}, "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": 1}}]}, "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "bogus"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "bogus"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, "response_format.json_schema.name"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"stop_token_ids": "x"}, "stop_token_ids"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"prompt": [1.5]}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [99999999]]}, "prompt"),
    ("/v1/completions", {"max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"logprobs": 100}, "logprobs"),
    ("/v1/completions", {"echo": 2}, "echo"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/responses", {"input": [{"type": "bogus"}]}, "input"),
    ("/v1/responses", {"max_output_tokens": 1.5}, "max_output_tokens"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools"),
    ("/v1/responses", {"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ("/v1/responses", {"text": {"format": {"type": "bogus"}}}, "text.format.type"),
    ("/v1/responses", {"reasoning": {"effort": "bogus"}}, "reasoning.effort"),
    ("/v1/responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
]


# Each case again with `stream: true` (but those about streaming itself): the refusal is an
# HTTP error, not an event in a stream already begun.
SWEEP_STREAMED = [(path, fields | {"stream": True}, param) for path, fields, param in SWEEP
                  if not {"stream", "stream_options"} & fields.keys()]


@pytest.mark.parametrize(("path", "fields", "param"), SWEEP + SWEEP_STREAMED)
def test_a_bad_field_is_a_400_naming_it_before_any_stream(
        mesh: RunningMesh, path: str, fields: dict[str, Any], param: str) -> None:
    body = with_fields(path, **fields)
    error = openai_error(post(mesh, path, body))
    assert error["param"] == param
    assert param.split(".")[0] in error["message"], error


@pytest.mark.parametrize("path", [*sorted(GENERATING), "/tokenize", "/detokenize"])
@pytest.mark.parametrize("body", [b"[]", b"1", b'"x"', b"{", b"\xef\xbb\xbf[]"])
def test_a_body_that_is_not_a_json_object_is_a_400(mesh: RunningMesh, path: str, body: bytes) -> None:
    error = openai_error(post(mesh, path, body))
    assert error["message"].startswith("body: "), error


@pytest.mark.parametrize("path", sorted(GENERATING))
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_a_415(mesh: RunningMesh, path: str, content_type: str) -> None:
    openai_error(post(mesh, path, GENERATING[path], content_type), 415)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "hi", "model": "nope"}, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "messages"),
    ("/detokenize", {"tokens": [1.5]}, "tokens.0"),
    ("/detokenize", {"tokens": [2**40]}, "tokens.0"),
    ("/detokenize", {"tokens": [99999999]}, "tokens"),
])
def test_tokenize_and_detokenize_name_the_bad_field(
        mesh: RunningMesh, path: str, body: dict[str, Any], param: str) -> None:
    error = openai_error(post(mesh, path, body), 404 if param == "model" else 400)
    assert error["param"] == param
