"""Long outputs fed a character at a time stay linear (no re-copying what was already seen).

The bound is loose on purpose (these run in about a second here); a quadratic parser needs
minutes for the same input.
"""

from __future__ import annotations

import json
import time

import pytest

from services.gateway.parsing import ChatOutputParser
from tests.parsing.model_outputs import DSML

NUM_CHARS = 60_000
TIME_LIMIT_S = 20.0
BIG_VALUE = ('x = "<a>" if y < z else "</b>"\n' * (NUM_CHARS // 30))[:NUM_CHARS]

LONG_OUTPUTS = {
    "argument": (
        f'</think>\n\n<{DSML}tool_calls>\n<{DSML}invoke name="write">\n'
        f'<{DSML}parameter name="text" string="true">{BIG_VALUE}</{DSML}parameter>\n'
        f"</{DSML}invoke>\n</{DSML}tool_calls>"
    ),
    "whitespace loop": "Answer." + "\n" * NUM_CHARS,
    "angle bracket loop": "Answer." + "<" * NUM_CHARS,
    "content": "</think>" + BIG_VALUE,
}


@pytest.mark.parametrize("name", sorted(LONG_OUTPUTS))
def test_one_character_deltas_stay_fast(name: str) -> None:
    text = LONG_OUTPUTS[name]
    parser = ChatOutputParser("deepseek_v4", "deepseek_v4", thinking=False)
    started = time.perf_counter()
    for char in text:
        parser.feed(char)
    parser.finish()
    elapsed_s = time.perf_counter() - started

    assert elapsed_s < TIME_LIMIT_S
    message = parser.message()
    if name == "argument":
        assert json.loads(message.tool_calls[0].arguments) == {"text": BIG_VALUE}
    elif name == "content":
        assert message.content == BIG_VALUE.strip()
    elif name == "angle bracket loop":
        # Every "<" is text except the last, which could still have become a tag when cut off.
        assert message.content == "Answer." + "<" * (NUM_CHARS - 1)
    else:
        assert message.content == "Answer."
