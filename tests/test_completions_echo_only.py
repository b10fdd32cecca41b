"""A completion that scores its prompt: `echo` with `max_tokens: 0` returns the prompt alone,
with its tokens' logprobs when asked, as OpenAI's legacy API and vLLM's server answer it; and
`max_tokens: null` is the default of 16, as in both."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
PROMPT = "The capital of France is Paris"


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(client: openai.OpenAI) -> None:
    with_generation = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                                max_tokens=1, echo=True, logprobs=1)
    generated = with_generation.choices[0].logprobs
    assert generated is not None and generated.tokens is not None
    num_prompt_tokens = len(generated.tokens) - 1

    scored = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=0,
                                       echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == PROMPT
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == generated.tokens[:num_prompt_tokens]
    assert choice.logprobs.token_logprobs == generated.token_logprobs[:num_prompt_tokens]  # type: ignore[index]
    assert choice.logprobs.token_logprobs[0] is None  # type: ignore[index]

    streamed, tokens = "", []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=0,
                                           echo=True, logprobs=1, stream=True):
        for streamed_choice in chunk.choices:
            streamed += streamed_choice.text
            tokens += streamed_choice.logprobs.tokens if streamed_choice.logprobs else []
    assert (streamed, tokens) == (PROMPT, choice.logprobs.tokens)


def test_max_tokens_0_without_echo_is_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_a_null_max_tokens_is_the_default_16(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                           max_tokens=None, extra_body={"ignore_eos": True})
    assert completion.usage is not None and completion.usage.completion_tokens == 16
    assert completion.choices[0].finish_reason == "length"
