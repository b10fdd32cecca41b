"""vLLM's `stream_options.continuous_usage_stats`: every chunk of a chat stream carries the usage
so far, the opening chunk of each choice (its role) included, as vLLM's server sends it."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def test_every_chunk_carries_the_usage_so_far(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1, seed=5, n=2, max_tokens=6, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True}))
    role_chunks = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.role]
    assert sorted(chunk.choices[0].index for chunk in role_chunks) == [0, 1]
    assert all(chunk.usage is not None for chunk in chunks), [c.usage for c in chunks]
    prompt_tokens = chunks[-1].usage.prompt_tokens  # type: ignore[union-attr]
    assert [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in role_chunks] == \
        [(prompt_tokens, 0)] * 2  # type: ignore[union-attr]
    assert chunks[-1].usage.completion_tokens == 12  # type: ignore[union-attr]
