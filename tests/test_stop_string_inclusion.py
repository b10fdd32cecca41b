"""vLLM's `include_stop_str_in_output`: the stop string that ended a choice stays in its text.

The matcher's rules on scripted text first, then the mesh end to end on the embedded model.
"""

from __future__ import annotations

import itertools

import openai
import pytest

from services.gateway.stop_strings import StopStringMatcher
from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
PROMPT = "Count to ten: 1, 2, 3,"


def _fed(stops: list[str], pieces: list[str], *, include_stop: bool) -> tuple[str, int | None]:
    """The text a matcher releases for `pieces`, and where in the whole text the stop ended."""
    matcher = StopStringMatcher(stops, include_stop=include_stop)
    released, num_fed = [], 0
    for piece in pieces:
        check = matcher.feed(piece)
        released.append(check.text)
        if check.stopped:
            return "".join(released), num_fed + check.stop_end
        num_fed += len(piece)
    return "".join(released) + matcher.flush(), None


def _splits(text: str) -> list[list[str]]:
    """Every way to cut `text` into pieces."""
    splits = []
    for num_cuts in range(len(text)):
        for cuts in itertools.combinations(range(1, len(text)), num_cuts):
            bounds = [0, *cuts, len(text)]
            splits.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return splits


@pytest.mark.parametrize("include_stop", [False, True])
def test_the_stop_that_ends_first_wins_however_the_text_is_split(include_stop: bool) -> None:
    # "cd" ends before "bcde" does, though "bcde" begins first: vLLM checks token by token.
    stops = ["bcde", "cd"]
    expected = "abcd" if include_stop else "ab"
    for pieces in _splits("abcdef"):
        assert _fed(stops, pieces, include_stop=include_stop) == (expected, 4), pieces


def test_an_included_stop_string_spanning_feeds_is_found_though_nothing_was_held() -> None:
    matcher = StopStringMatcher(["END"], include_stop=True)
    assert matcher.feed("one E").text == "one E"  # nothing held back: the stop is kept anyway
    check = matcher.feed("ND two")
    assert (check.text, check.stopped, check.stop_end) == ("ND", True, 2)
    assert matcher.feed("more").text == "" and matcher.flush() == ""


def test_text_without_a_stop_string_comes_out_whole() -> None:
    for include_stop in (False, True):
        for pieces in _splits("a ENbE"):
            assert _fed(["END", "x"], pieces, include_stop=include_stop) == ("a ENbE", None)


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def _stop_within(text: str) -> str:
    """A stop string the text reaches well after its start: three characters from its middle."""
    start = len(text) // 2
    stop = text[start:start + 3]
    assert stop.strip(), text
    return stop


def test_completion_keeps_its_stop_string_and_counts_the_tokens_up_to_it(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12,
                                     logprobs=0)
    text = free.choices[0].text
    stop = _stop_within(text)
    stop_end = text.index(stop) + len(stop)
    # The tokens it takes to reach the end of the stop string; later ones are not generated.
    token_ends = list(itertools.accumulate(len(t) for t in free.choices[0].logprobs.tokens))
    num_tokens = next(i for i, end in enumerate(token_ends, start=1) if end >= stop_end)

    kept = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12,
                                     stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:stop_end] and kept.choices[0].text.endswith(stop)
    assert kept.choices[0].finish_reason == "stop"
    assert kept.usage.completion_tokens == num_tokens

    dropped = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12,
                                        stop=[stop])
    assert dropped.choices[0].text == text[:text.index(stop)]
    assert dropped.usage.completion_tokens == num_tokens

    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12, stop=[stop], stream=True,
        stream_options={"include_usage": True}, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == kept.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == num_tokens


def test_chat_keeps_its_stop_string_streamed_and_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "List three colours, separated by commas."}]
    free = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    text = free.choices[0].message.content
    stop = _stop_within(text)
    expected = text[:text.index(stop) + len(stop)]

    kept = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16,
                                          stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == expected
    assert kept.choices[0].finish_reason == "stop"
    assert kept.usage.completion_tokens <= free.usage.completion_tokens

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16, stop=stop, stream=True,
        stream_options={"include_usage": True}, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == kept.usage.completion_tokens
