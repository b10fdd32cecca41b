"""vLLM's `prompt_logprobs`, and `echo` with `logprobs` on completions, end to end on the
embedded model."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
PROMPT = "The capital of France is"
# Prefill and decode score a token in different kernels; they agree to about this.
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt_tokens(mesh: RunningMesh) -> tuple[list[int], list[str]]:
    """The prompt's token ids, and each token decoded on its own."""
    reply = httpx.post(mesh.base_url.removesuffix("/v1") + "/tokenize",
                       json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}, timeout=60)
    reply.raise_for_status()
    return reply.json()["tokens"], reply.json()["token_strs"]


def _check_prompt_logprobs(entries: list[Any], token_ids: list[int], token_texts: list[str],
                           num_top: int) -> None:
    assert len(entries) == len(token_ids) and entries[0] is None
    for entry, token_id, text in zip(entries[1:], token_ids[1:], token_texts[1:], strict=True):
        # The prompt's own token first, then the top `num_top`, the prompt token among them once.
        assert next(iter(entry)) == str(token_id)
        assert entry[str(token_id)]["decoded_token"] == text
        assert len(entry) in (num_top, num_top + 1)
        top = sorted(entry.values(), key=lambda candidate: candidate["rank"])[:num_top]
        assert [c["rank"] for c in top] == list(range(1, num_top + 1))
        assert [c["logprob"] for c in top] == sorted((c["logprob"] for c in top), reverse=True)
        own = entry[str(token_id)]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        assert (own["rank"] <= num_top) == (len(entry) == num_top)
        assert set(own) == {"logprob", "rank", "decoded_token"}


def test_completion_prompt_logprobs_score_every_prompt_token(
        client: openai.OpenAI, prompt_tokens: tuple[list[int], list[str]]) -> None:
    token_ids, token_texts = prompt_tokens
    reply = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=2,
                                      extra_body={"prompt_logprobs": 2})
    assert reply.usage.prompt_tokens == len(token_ids)
    _check_prompt_logprobs(reply.choices[0].prompt_logprobs, token_ids, token_texts, num_top=2)

    only_own = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=2,
                                         extra_body={"prompt_logprobs": 0})
    entries = only_own.choices[0].prompt_logprobs
    assert [list(e) if e else None for e in entries] == [None] + [[str(t)] for t in token_ids[1:]]
    # Deterministic: the same prompt scores the same.
    assert all(e[str(t)] == full[str(t)] for e, full, t in
               zip(entries[1:], reply.choices[0].prompt_logprobs[1:], token_ids[1:]))


def test_chat_prompt_logprobs_are_a_top_level_field(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=1,
        extra_body={"prompt_logprobs": 1})
    entries = reply.model_extra["prompt_logprobs"]
    assert len(entries) == reply.usage.prompt_tokens and entries[0] is None
    assert all(1 <= len(e) <= 2 for e in entries[1:])
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=1)
    assert "prompt_logprobs" not in plain.model_extra


def test_a_generated_tokens_logprob_equals_its_prompt_logprob_once_the_prompt_holds_it(
        client: openai.OpenAI, prompt_tokens: tuple[list[int], list[str]]) -> None:
    token_ids, _ = prompt_tokens
    generated = client.completions.create(model=MODEL, prompt=token_ids, temperature=0, max_tokens=1,
                                          logprobs=1)
    token_text = generated.choices[0].logprobs.tokens[0]
    sampled_logprob = generated.choices[0].logprobs.token_logprobs[0]
    # The greedy token after the prompt is the top candidate at the position after it.
    probe = client.completions.create(model=MODEL, prompt=token_ids + [token_ids[0]], max_tokens=1,
                                      extra_body={"prompt_logprobs": 1})
    (next_id, best), = [(int(i), c) for i, c in probe.choices[0].prompt_logprobs[-1].items()
                        if c["rank"] == 1]
    assert best["decoded_token"] == token_text

    extended = client.completions.create(model=MODEL, prompt=token_ids + [next_id], max_tokens=1,
                                         extra_body={"prompt_logprobs": 1})
    last = extended.choices[0].prompt_logprobs[-1]
    assert list(last) == [str(next_id)]  # the greedy token is its own top candidate
    assert last[str(next_id)]["rank"] == 1
    assert last[str(next_id)]["logprob"] == pytest.approx(sampled_logprob, abs=LOGPROB_TOLERANCE)
    assert last[str(next_id)]["logprob"] == pytest.approx(best["logprob"], abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize(("fields", "route"), [
    ({"prompt_logprobs": 1, "stream": True}, "completions"),
    ({"prompt_logprobs": 1, "stream": True}, "chat/completions"),
    ({"prompt_logprobs": 21}, "completions"),
    ({"prompt_logprobs": -1}, "chat/completions"),
])
def test_prompt_logprobs_out_of_range_or_streamed_are_refused_by_name(
        mesh: RunningMesh, fields: dict[str, Any], route: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, **fields}
    body |= ({"prompt": PROMPT} if route == "completions"
             else {"messages": [{"role": "user", "content": "Hi"}]})
    reply = httpx.post(f"{mesh.base_url}/{route}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt_logprobs" and error["type"] == "invalid_request_error"


def test_echo_with_logprobs_covers_the_prompt_tokens_streamed_and_not(
        client: openai.OpenAI, prompt_tokens: tuple[list[int], list[str]]) -> None:
    token_ids, token_texts = prompt_tokens
    whole = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3,
                                      logprobs=2, echo=True)
    choice = whole.choices[0]
    logprobs = choice.logprobs
    num_prompt = len(token_ids)
    assert len(logprobs.tokens) == num_prompt + whole.usage.completion_tokens
    assert logprobs.tokens[:num_prompt] == token_texts
    assert "".join(logprobs.tokens) == choice.text and choice.text.startswith(PROMPT)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset == [0, *itertools.accumulate(len(t) for t in logprobs.tokens[:-1])]
    # The prompt's entries are the engine's prompt logprobs, which vLLM returns beside them.
    scored = choice.prompt_logprobs
    for i in range(1, num_prompt):
        own = scored[i][str(token_ids[i])]
        assert logprobs.token_logprobs[i] == own["logprob"]
        assert logprobs.top_logprobs[i] == {c["decoded_token"]: c["logprob"] for c in scored[i].values()}
        assert token_texts[i] in logprobs.top_logprobs[i] and len(logprobs.top_logprobs[i]) <= 3

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3,
                                            logprobs=2, echo=True, stream=True))
    first = chunks[0].choices[0].logprobs
    assert first.tokens[:num_prompt] == token_texts and first.text_offset[0] == 0
    streamed = {name: [v for c in chunks if c.choices[0].logprobs
                       for v in getattr(c.choices[0].logprobs, name)]
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == {name: getattr(logprobs, name)
                        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert "".join(c.choices[0].text for c in chunks) == choice.text
