"""Random conversations: our DeepSeek-V4 prompt equals vLLM's for any valid request shape.

The corpus covers the shapes clients send; this covers the orderings nobody thought of
(tool results at the start, assistant after assistant, trailing system turns, ...).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from services.tokenizer.chat_formats import DeepseekV4Renderer
from tests.chat_formats.deepseek_v4_corpus import BARE_TOOL, SEARCH_TOOL, WEATHER_TOOL

pytest.importorskip("vllm.tokenizers.deepseek_v4", reason="vllm is not installed")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402

from tests.chat_formats.test_deepseek_v4_parity import vllm_prompt  # noqa: E402

TEXT = st.text(alphabet=st.sampled_from(list('ab <>/"\n\u00e9{}')), max_size=8)
JSON_VALUE = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | TEXT,
                          lambda inner: st.lists(inner, max_size=2) | st.dictionaries(TEXT, inner, max_size=2),
                          max_leaves=4)
CONTENT = TEXT | st.lists(TEXT.map(lambda text: {"type": "text", "text": text}), min_size=1, max_size=3)


@st.composite
def assistant_messages(draw: st.DrawFn) -> dict[str, Any]:
    calls = draw(st.lists(st.tuples(st.sampled_from(["get_weather", "search_docs", "now"]),
                                    st.dictionaries(st.sampled_from(["city", "query", "n"]), JSON_VALUE, max_size=2)),
                          max_size=2))
    message: dict[str, Any] = {"role": "assistant",
                               "content": draw(st.none() | CONTENT) if calls else draw(CONTENT)}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(arguments)}}
                                 for i, (name, arguments) in enumerate(calls)]
    reasoning = draw(st.none() | TEXT)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


MESSAGE = st.one_of(
    st.builds(lambda content: {"role": "user", "content": content}, CONTENT),
    st.builds(lambda content: {"role": "system", "content": content}, CONTENT),
    st.builds(lambda text: {"role": "developer", "content": "d" + text}, TEXT),
    st.builds(lambda call, content: {"role": "tool", "tool_call_id": f"call_{call}", "content": content},
              st.integers(0, 2), CONTENT),
    assistant_messages(),
)
TOOLS = st.none() | st.lists(st.sampled_from([WEATHER_TOOL, SEARCH_TOOL, BARE_TOOL]), min_size=1, max_size=3,
                             unique_by=lambda tool: tool["function"]["name"])
KWARGS = st.fixed_dictionaries({}, optional={
    "thinking": st.booleans(), "enable_thinking": st.booleans(), "drop_thinking": st.booleans(),
    "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max"])})


@hypothesis.settings(max_examples=150, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(messages=st.lists(MESSAGE, min_size=1, max_size=7), tools=TOOLS, template_kwargs=KWARGS)
def test_random_conversations_match_vllm(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                                         template_kwargs: dict[str, Any]) -> None:
    expected = vllm_prompt(messages, tools, chat_template_kwargs=dict(template_kwargs))
    assert DeepseekV4Renderer().render(copy.deepcopy(messages), copy.deepcopy(tools), template_kwargs) == expected
