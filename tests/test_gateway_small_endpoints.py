"""The gateway's small endpoints under bad input: `/tokenize`, `/detokenize`, `/v1/models`.
Every refusal is a 4xx in OpenAI's error shape naming the field, never a 500. Real `backport up`
(the shared mesh), real HTTP."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import RunningMesh

ERROR_FIELDS = {"message", "type", "param", "code"}


def root_of(mesh: RunningMesh) -> str:
    return mesh.base_url.removesuffix("/v1")


def post_raw(mesh: RunningMesh, path: str, body: bytes) -> httpx.Response:
    """`body` as sent, so it can hold what json.dumps would not write (a lone surrogate escape)."""
    return httpx.post(f"{root_of(mesh)}{path}", content=body,
                      headers={"content-type": "application/json"}, timeout=60)


def openai_error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == ERROR_FIELDS, error
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", b'{"prompt": "a\\udfff"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages"),
    ("/tokenize", b'{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/detokenize", b'{"tokens": [1], "model": "\\ud800"}', "model"),
])
def test_a_lone_surrogate_in_tokenize_or_detokenize_is_400_naming_the_field(
        mesh: RunningMesh, path: str, body: bytes, param: str) -> None:
    """Was a 500: the prompt failed in the tokenizer call, messages in the chat request built
    inside the handler, a model name in the 404 that echoed it."""
    error = openai_error(post_raw(mesh, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"]


def test_a_tokenize_message_without_a_role_is_400_as_in_chat(mesh: RunningMesh) -> None:
    """Was a 500: the chat path's check ran inside the handler, past request validation."""
    reply = httpx.post(f"{root_of(mesh)}/tokenize", json={"messages": [{"content": "hi"}]},
                       timeout=60)
    error = openai_error(reply, 400)
    assert error["param"] == "messages" and "role" in error["message"]


def test_tokenize_takes_a_null_return_token_strs_as_its_default_as_vllm_does(
        mesh: RunningMesh) -> None:
    reply = httpx.post(f"{root_of(mesh)}/tokenize",
                       json={"prompt": "Hello there", "return_token_strs": None}, timeout=60)
    assert reply.status_code == 200, reply.text
    tokenized = reply.json()
    assert tokenized["token_strs"] is None and tokenized["count"] == len(tokenized["tokens"]) > 0


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", b"", None),
    ("/tokenize", b'["hello"]', None),
    ("/tokenize", b'{"prompt": 5}', "prompt"),
    ("/tokenize", b'{"prompt": "hi", "add_special_tokens": "sometimes"}', "add_special_tokens"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [1]}', "tools.0"),
    ("/detokenize", b"{}", "tokens"),
    ("/detokenize", b'{"tokens": "1 2 3"}', "tokens"),
    ("/detokenize", b'{"tokens": [-1]}', "tokens.0"),
    ("/detokenize", b'{"tokens": [1.5]}', "tokens.0"),
    ("/detokenize", b'{"tokens": [18446744073709551616]}', "tokens.0"),
])
def test_malformed_tokenize_and_detokenize_bodies_are_400_naming_the_field(
        mesh: RunningMesh, path: str, body: bytes, param: str | None) -> None:
    error = openai_error(post_raw(mesh, path, body), 400)
    assert error["param"] == param
    assert error["message"].startswith(f"{param or 'body'}:"), error


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("GET", "/tokenize", "POST"), ("PUT", "/detokenize", "POST"), ("POST", "/v1/models", "GET"),
    ("DELETE", "/v1/models/SmolLM2-135M-Instruct-bf16", "GET"), ("POST", "/health", "GET, HEAD"),
])
def test_a_wrong_method_is_405_in_openai_shape_naming_the_allowed_one(
        mesh: RunningMesh, method: str, path: str, allowed: str) -> None:
    reply = httpx.request(method, f"{root_of(mesh)}{path}", timeout=60)
    openai_error(reply, 405)
    assert set(reply.headers["allow"].split(", ")) == set(allowed.split(", "))


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_a_reserved_template_kwarg_is_400_naming_chat_template_kwargs(
        mesh: RunningMesh, path: str) -> None:
    """Was `param: messages`: the tokenizer service's message named the right field."""
    reply = httpx.post(f"{root_of(mesh)}{path}", timeout=60, json={
        "model": "SmolLM2-135M-Instruct-bf16", "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"add_generation_prompt": 5}, "max_tokens": 1})
    error = openai_error(reply, 400)
    assert error["param"] == "chat_template_kwargs"
    assert error["message"].startswith("chat_template_kwargs.add_generation_prompt")


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_continue_final_message_with_add_generation_prompt_sent_true_is_400(
        mesh: RunningMesh, path: str) -> None:
    """As vLLM: the two end the prompt in opposite ways (continue_final_message won before).
    Sent alone, continue_final_message overrides add_generation_prompt's default."""
    body = {"model": "SmolLM2-135M-Instruct-bf16", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
            "continue_final_message": True}
    error = openai_error(httpx.post(f"{root_of(mesh)}{path}", timeout=60,
                                    json=body | {"add_generation_prompt": True}), 400)
    assert error["param"] == "continue_final_message"
    assert httpx.post(f"{root_of(mesh)}{path}", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_a_chat_template_in_the_request_is_400_on_tokenize_as_on_chat(mesh: RunningMesh, path: str) -> None:
    """As vLLM: counting with the model's template instead would answer for another prompt than
    the one asked about (/tokenize ignored it, a 200)."""
    reply = httpx.post(f"{root_of(mesh)}{path}", timeout=60, json={
        "model": "SmolLM2-135M-Instruct-bf16", "messages": [{"role": "user", "content": "hi"}],
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}", "max_tokens": 1})
    assert openai_error(reply, 400)["param"] == "chat_template"


@pytest.mark.parametrize(("path", "content_type"), [
    ("/v1/chat/completions", "text/plain"),
    ("/v1/completions", "application/x-www-form-urlencoded"),  # curl -d without -H
    ("/tokenize", None),
])
def test_a_json_body_under_another_content_type_is_415_naming_it(
        mesh: RunningMesh, path: str, content_type: str | None) -> None:
    """FastAPI reads only JSON media types; the error blamed the body ("Input should be a valid
    dictionary") when the body was a valid object and the Content-Type was what was wrong."""
    headers = {"content-type": content_type} if content_type else {}
    body = b'{"model": "SmolLM2-135M-Instruct-bf16", "prompt": "hi", "max_tokens": 1}'
    reply = httpx.post(f"{root_of(mesh)}{path}", content=body, headers=headers, timeout=60)
    error = openai_error(reply, 415)
    assert f"(got {content_type or 'none'})" in error["message"]
    sent_as_json = httpx.post(f"{root_of(mesh)}/tokenize", content=body, timeout=60,
                              headers={"content-type": "application/json; charset=utf-8"})
    assert sent_as_json.status_code == 200, sent_as_json.text
