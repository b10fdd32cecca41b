"""vLLM's sampling fields that the gateway once accepted and ignored, answering another
request than the one sent: the ones served are refused as vLLM refuses them, naming the field;
those that change vLLM's output and are not served here are refused by name (400). vLLM's own
server serves the latter, so they are no cases of `test_vllm_server_parity.py`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def post(mesh: RunningMesh, path: str, fields: dict[str, Any]) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0} | fields
    if path == "chat/completions":
        body["messages"] = QUESTION
    else:
        body["prompt"] = "The capital of France is"
    return httpx.post(f"{mesh.base_url}/{path}", json=body, timeout=120)


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("completions", {"allowed_token_ids": [504, 49152]}, "allowed_token_ids"),  # vocabulary: 49,152
    ("chat/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("chat/completions", {"bad_words": ["Paris", ""]}, "bad_words"),
])
def test_a_bad_allowed_token_or_bad_word_is_400_naming_its_field(
        mesh: RunningMesh, path: str, fields: dict[str, Any], param: str) -> None:
    reply = post(mesh, path, fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith(param), reply.text


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("chat/completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat/completions", {"logprobs": True, "logprob_token_ids": [504, 3575]}, "logprob_token_ids"),
    ("completions", {"logprobs": 2, "logprob_token_ids": [504, 3575]}, "logprob_token_ids"),
    ("chat/completions", {"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection"),
    ("completions", {"vllm_xargs": {"threshold": 0.5}}, "vllm_xargs"),
    ("chat/completions", {"skip_special_tokens": False, "spaces_between_special_tokens": False},
     "spaces_between_special_tokens"),
])
def test_an_unserved_vllm_field_is_400_naming_it(mesh: RunningMesh, path: str,
                                                 fields: dict[str, Any], param: str) -> None:
    reply = post(mesh, path, fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
@pytest.mark.parametrize(("budget", "says"), [
    (8, "--reasoning-parser"), (-2, "greater than or equal to -1"), (3.5, "valid integer"),
    (True, "valid integer")])
def test_a_thinking_budget_this_engine_cannot_keep_is_400_naming_it(
        mesh: RunningMesh, path: str, budget: object, says: str) -> None:
    """The embedded model's engine has no reasoning parser to tell where the reasoning ends
    (tests/e2e/test_deepseek_v4_mesh.py keeps a budget); -1 means no limit and is served."""
    reply = post(mesh, path, {"thinking_token_budget": budget})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "thinking_token_budget", reply.text
    assert says in reply.json()["error"]["message"], reply.text
    assert post(mesh, path, {"thinking_token_budget": -1}).status_code == 200


@pytest.mark.parametrize(("path", "fields"), [
    ("chat/completions", {"use_beam_search": False, "logprob_token_ids": None,
                          "thinking_token_budget": None, "repetition_detection": None,
                          "vllm_xargs": {}}),
    ("completions", {"logprob_token_ids": [], "spaces_between_special_tokens": False}),
])
def test_values_that_ask_for_nothing_are_served(mesh: RunningMesh, path: str,
                                                fields: dict[str, Any]) -> None:
    """Such fields at their defaults (as clients that fill every field send them), and
    `spaces_between_special_tokens: false` where no special token is shown."""
    reply = post(mesh, path, fields)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2
