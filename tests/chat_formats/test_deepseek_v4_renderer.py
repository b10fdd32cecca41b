"""DeepSeek-V4 renderer behaviour that holds with or without vLLM installed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.tokenizer.chat_formats import ChatRenderError, DeepseekV4Mode, DeepseekV4Renderer
from services.tokenizer.chat_formats.deepseek_v4 import ASSISTANT, BOS, DSML, EFFORT_PREAMBLES, EOS, USER
from tests.chat_formats.deepseek_v4_corpus import CONVERSATIONS, WEATHER_TOOL

RENDERER = DeepseekV4Renderer()


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    return RENDERER.render(messages, tools, kwargs)


def test_thinking_mode_ends_with_think_and_chat_mode_with_end_think() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert render(messages).endswith(f"{USER}hi{ASSISTANT}<think>")
    assert render(messages, thinking=False) == f"{BOS}{USER}hi{ASSISTANT}</think>"
    assert render(messages, reasoning_effort="none") == f"{BOS}{USER}hi{ASSISTANT}</think>"


@pytest.mark.parametrize(("effort", "preamble"), [
    (None, "high"), ("minimal", "low"), ("low", "low"), ("medium", "low"), ("high", "high"), ("xhigh", "high"),
    ("max", "max")])
def test_effort_preamble_follows_bos_in_thinking_mode(effort: str | None, preamble: str) -> None:
    prompt = render([{"role": "user", "content": "hi"}], reasoning_effort=effort)
    assert prompt == f"{BOS}{EFFORT_PREAMBLES[preamble]}{USER}hi{ASSISTANT}<think>"  # type: ignore[index]


def test_tools_block_lists_each_schema_in_the_system_turn() -> None:
    prompt = render([{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}], [WEATHER_TOOL],
                    thinking=False)
    system_turn = prompt[len(BOS):prompt.index(USER)]
    assert system_turn.startswith("sys\n\n## Tools\n")
    assert json.dumps(WEATHER_TOOL["function"], ensure_ascii=False) in system_turn.splitlines()


def test_tool_call_history_becomes_dsml_and_results_join_the_next_user_turn() -> None:
    messages, tools = CONVERSATIONS["tool_round_trip"]
    prompt = render(messages, tools)
    assert (f'{ASSISTANT}<think>Need the tool.</think>\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
            f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
            f'<{DSML}parameter name="unit" string="true">c</{DSML}parameter>\n'
            f'</{DSML}invoke>\n</{DSML}tool_calls>{EOS}') in prompt
    assert prompt.endswith(f'{USER}<tool_result>{{"temp": 21, "sky": "clear"}}</tool_result>{ASSISTANT}<think>')


def test_earlier_reasoning_is_dropped_without_tools_and_kept_with_them() -> None:
    messages, _ = CONVERSATIONS["tools_listed_never_called"]
    without_tools = render(messages)
    assert "no tool needed" not in without_tools
    assert f"{ASSISTANT}</think>Hello{EOS}" in without_tools
    with_tools = render(messages, [WEATHER_TOOL])
    assert f"{ASSISTANT}<think>no tool needed</think>Hello{EOS}" in with_tools


def test_no_generation_prompt_leaves_the_last_turn_open() -> None:
    prompt = RENDERER.render([{"role": "user", "content": "hi"}], None, {"thinking": False},
                             add_generation_prompt=False)
    assert prompt == f"{BOS}{USER}hi"


def test_continue_final_message_drops_eos_and_keeps_open_reasoning_open() -> None:
    answer = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Partial ans"}]
    assert RENDERER.render(answer, None, {"thinking": False}, add_generation_prompt=False,
                           continue_final_message=True) == f"{BOS}{USER}q{ASSISTANT}</think>Partial ans"
    reasoning_only = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                           "reasoning_content": "Let me"}]
    prompt = RENDERER.render(reasoning_only, None, {"reasoning_effort": "low"}, add_generation_prompt=False,
                             continue_final_message=True)
    assert prompt == f"{BOS}{USER}q{ASSISTANT}<think>Let me"


@pytest.mark.parametrize(("messages", "field"), [
    ([], "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "q"}, {"role": "function", "name": "f", "content": "x"}], "messages[1].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                         "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}],
     "messages[1].tool_calls[0].function.name"),
    ([{"role": "developer", "content": ""}, {"role": "user", "content": "q"}], "messages[0].content"),
])
def test_bad_messages_raise_an_error_naming_the_field(messages: list[dict[str, Any]], field: str) -> None:
    with pytest.raises(ChatRenderError) as caught:
        render(messages)
    assert caught.value.field == field
    assert str(caught.value).startswith(field + ":")


def test_bad_tools_and_flags_raise_an_error_naming_the_field() -> None:
    user = [{"role": "user", "content": "q"}]
    with pytest.raises(ChatRenderError, match=r"^tools\[0\]\.function\.name:"):
        render(user, [{"type": "function", "function": {"description": "nameless"}}])
    with pytest.raises(ChatRenderError, match=r"^messages\[0\]\.role:"):
        RENDERER.render(user, None, {}, add_generation_prompt=False, continue_final_message=True)


def test_mode_reads_template_kwargs_like_vllm() -> None:
    assert DeepseekV4Mode.from_template_kwargs({}) == DeepseekV4Mode(True, "high")
    assert DeepseekV4Mode.from_template_kwargs({"enable_thinking": False}).is_thinking is False
    assert DeepseekV4Mode.from_template_kwargs({"thinking": False, "enable_thinking": True}).is_thinking is True
    assert DeepseekV4Mode.from_template_kwargs({"drop_thinking": False}).drop_earlier_reasoning is False
