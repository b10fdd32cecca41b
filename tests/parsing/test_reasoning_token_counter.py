"""`ReasoningTokenCounter`: which output tokens count as reasoning, by token id."""

from __future__ import annotations

import pytest

from services.gateway.reasoning_tokens import ReasoningMarkerIds, ReasoningTokenCounter

START, END = 7, 8
MARKERS = ReasoningMarkerIds(START, END)


@pytest.mark.parametrize(("thinking", "output", "expected"), [
    # The model opens and closes the block (Qwen3 writing <think>): the markers do not count.
    (False, [START, 1, 2, 3, END, 4, 5], 3),
    # The prompt opened it: from the first token; a duplicate <think> inside is no token of it.
    (True, [1, 2, START, 3, END, 4], 3),
    # Chat mode with a stray </think>: nothing was reasoning.
    (False, [1, 2, END, 3], 0),
    # Cut off inside the reasoning: every token so far.
    (True, [1, 2, 3, 4], 4),
    # Reasoning never opened.
    (False, [1, 2, 3], 0),
])
def test_counts_the_tokens_inside_the_reasoning(thinking: bool, output: list[int],
                                               expected: int) -> None:
    whole = ReasoningTokenCounter(MARKERS, thinking=thinking)
    assert whole.feed(output) == expected
    one_by_one = ReasoningTokenCounter(MARKERS, thinking=thinking)
    assert [one_by_one.feed([token]) for token in output][-1] == expected
