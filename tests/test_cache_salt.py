"""`cache_salt` (vLLM's): a prompt's cached KV is shared only among requests of the same salt, so
one tenant cannot tell from `cached_tokens` (or from timing) what another has sent. Real mesh,
real vLLM prefix cache, the official openai client."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def _cached_tokens(client: openai.OpenAI, prompt: str, salt: str | None) -> int:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"cache_salt": salt} if salt else None)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_cached_prompt_tokens_are_shared_only_under_the_same_salt(client: openai.OpenAI) -> None:
    # Fresh text, so nothing from other tests is cached; long enough to fill many KV blocks.
    prompt = f"Request {uuid.uuid4()}: " + "the quick brown fox jumps over the lazy dog. " * 40
    assert _cached_tokens(client, prompt, "tenant-a") == 0
    assert _cached_tokens(client, prompt, "tenant-a") > 100
    assert _cached_tokens(client, prompt, "tenant-b") == 0
    assert _cached_tokens(client, prompt, None) == 0
    assert _cached_tokens(client, prompt, None) > 100


def test_the_salt_reaches_chat_and_responses_too(client: openai.OpenAI) -> None:
    text = f"Note {uuid.uuid4()}: " + "pack my box with five dozen liquor jugs. " * 40
    messages = [{"role": "user", "content": text}]

    def chat_cached(salt: str) -> int:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                               extra_body={"cache_salt": salt})
        return reply.usage.prompt_tokens_details.cached_tokens

    def responses_cached(salt: str) -> int:
        reply = client.responses.create(model=MODEL, input=text, max_output_tokens=1,
                                        extra_body={"cache_salt": salt})
        return reply.usage.input_tokens_details.cached_tokens

    assert chat_cached("tenant-a") == 0
    assert chat_cached("tenant-a") > 100
    assert responses_cached("tenant-b") == 0
    assert responses_cached("tenant-b") > 100


@pytest.mark.parametrize("salt", ["", "a/b", "x" * 129, "user@example", 5])
def test_a_salt_vllm_would_refuse_is_400_naming_the_field(client: openai.OpenAI, salt: object) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1, extra_body={"cache_salt": salt})
    assert caught.value.body["param"] == "cache_salt"
