"""vLLM's `min_tokens` holds stop strings off too: a stop string that ends within a choice's
first `min_tokens` tokens does not end it (vLLM's detokenizer checks stop strings only past
them), so the choice runs on to the next stop string that ends later."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
PROMPT = "1, 2, 3,"
STOP = ","
MIN_TOKENS = 4


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def _expected_text(client: openai.OpenAI) -> str:
    """The greedy text up to the first stop string that ends past the first MIN_TOKENS tokens."""
    free = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=16,
                                     logprobs=0)
    choice = free.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    num_protected_chars = len("".join(choice.logprobs.tokens[:MIN_TOKENS]))
    # The unprotected run of the counting text must hold a stop of its own for the test to say
    # anything: the first stop the greedy text reaches lies within the protected tokens.
    assert choice.text.find(STOP) + len(STOP) <= num_protected_chars, choice.logprobs.tokens
    stop_start = choice.text.find(STOP, num_protected_chars - len(STOP) + 1)
    assert stop_start >= 0, choice.text
    return choice.text[:stop_start]


def test_a_stop_string_within_min_tokens_does_not_end_the_choice(client: openai.OpenAI) -> None:
    expected = _expected_text(client)
    request = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=16, stop=[STOP],
                   extra_body={"min_tokens": MIN_TOKENS})

    whole = client.completions.create(**request)  # type: ignore[call-overload]
    choice = whole.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra is not None and choice.model_extra["stop_reason"] == STOP
    assert whole.usage is not None and whole.usage.completion_tokens > MIN_TOKENS

    streamed, finish_reason = "", None
    for chunk in client.completions.create(**request, stream=True):  # type: ignore[call-overload]
        for streamed_choice in chunk.choices:
            streamed += streamed_choice.text
            finish_reason = streamed_choice.finish_reason or finish_reason
    assert (streamed, finish_reason) == (expected, "stop")
