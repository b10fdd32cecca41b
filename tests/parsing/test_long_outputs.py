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


# Degenerate markup inside one closed call: tags that never close, as a looping model or a value
# quoting the format writes them. Parsing the call must not retry each tag against the rest.
# Each case: family, output, the calls expected (none of the tags makes an argument).
UNCLOSED_MARKUP_CALLS = {
    "glm47 keys and values without closing tags": (
        "glm47",
        "<tool_call>write" + "<arg_key>k</arg_key><arg_value>v" * 1000 + "</tool_call>",
        ["write"],
    ),
    "glm47 keys without closing tags": (
        "glm47",
        "<tool_call>write" + "<arg_key>k" * 40_000 + "</tool_call>",
        ["write"],
    ),
    "qwen3_xml parameter heads without >": (
        "qwen3_xml",
        "<tool_call>\n<function=write>\n" + "<parameter=k" * 40_000 + "</function>\n</tool_call>",
        ["write"],
    ),
    "qwen3_xml function heads without >": (
        "qwen3_xml",
        "<tool_call>\n" + "<function=write" * 40_000 + "</tool_call>",
        [],
    ),
}


@pytest.mark.parametrize("name", sorted(UNCLOSED_MARKUP_CALLS))
def test_a_call_full_of_unclosed_tags_parses_in_linear_time(name: str) -> None:
    family, text, expected_names = UNCLOSED_MARKUP_CALLS[name]
    parser = ChatOutputParser(family)
    started = time.perf_counter()
    parser.feed(text)
    parser.finish()
    elapsed_s = time.perf_counter() - started

    assert elapsed_s < TIME_LIMIT_S
    calls = parser.message().tool_calls
    assert [call.name for call in calls] == expected_names
    assert all(json.loads(call.arguments) == {} for call in calls)
