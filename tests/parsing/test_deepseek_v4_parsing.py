"""DeepSeek-V4: DSML tool calls and `<think>` reasoning on realistic outputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.parsing.model_outputs import DEEPSEEK_EOS, DSML
from tests.parsing.streaming_harness import arguments_of, parse_every_way

DEEPSEEK = {"tool_call_parser": "deepseek_v4", "reasoning_parser": "deepseek_v4"}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "overwrite": {"type": "boolean"},
                    "mode": {"type": ["integer", "null"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "agent_id": {"type": "string"},
                    "limit": {"type": "integer"},
                    "filters": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "min_score": {"type": "number"},
                },
            },
        },
    },
]

PYTHON_SOURCE = 'def f(a, b):\n    """Return "a < b" as <bool>."""\n    return a < b and b > 0\n'


def _parameter(name: str, value: str, is_string: bool) -> str:
    flag = "true" if is_string else "false"
    return f'<{DSML}parameter name="{name}" string="{flag}">{value}</{DSML}parameter>'


REALISTIC_OUTPUT = (
    "The user wants a file and a search. I'll write the file first, then search.\n"
    'Edge: the source has "quotes" and <angle> brackets.\n'
    "</think>\n\n"
    "I'll write the file and look up related code.\n\n"
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="write_file">\n'
    + _parameter("path", "src/compare.py", True)
    + "\n"
    + _parameter("content", PYTHON_SOURCE, True)
    + "\n"
    + _parameter("overwrite", "true", False)
    + "\n"
    + _parameter("mode", "null", False)
    + "\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="search">\n'
    + _parameter("query", 'compare <T> in "src"', True)
    + "\n"
    + _parameter("agent_id", "007", True)
    + "\n"
    + _parameter("limit", "3", True)
    + "\n"
    + _parameter(
        "filters",
        '{"lang": "python", "path": {"prefix": "src/", "depth": 2}, "archived": false}',
        False,
    )
    + "\n"
    + _parameter("tags", '["a", "b<c>"]', False)
    + "\n"
    + _parameter("min_score", "0.25", False)
    + "\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>{DEEPSEEK_EOS}"
)


def test_realistic_thinking_output_with_two_calls() -> None:
    message = parse_every_way(REALISTIC_OUTPUT, tools=TOOLS, thinking=True, **DEEPSEEK)

    assert message.reasoning_content == (
        "The user wants a file and a search. I'll write the file first, then search.\n"
        'Edge: the source has "quotes" and <angle> brackets.'
    )
    assert message.content == "I'll write the file and look up related code."
    assert arguments_of(message) == [
        (
            "write_file",
            {"path": "src/compare.py", "content": PYTHON_SOURCE, "overwrite": True, "mode": None},
        ),
        (
            "search",
            {
                "query": 'compare <T> in "src"',
                "agent_id": "007",
                "limit": 3,
                "filters": {
                    "lang": "python",
                    "path": {"prefix": "src/", "depth": 2},
                    "archived": False,
                },
                "tags": ["a", "b<c>"],
                "min_score": 0.25,
            },
        ),
    ]
    assert message.has_tool_calls


def test_chat_mode_output_is_all_content_and_a_stray_think_end_is_dropped() -> None:
    message = parse_every_way(
        f"</think>Paris is the capital of France.{DEEPSEEK_EOS}", thinking=False, **DEEPSEEK
    )

    assert message.reasoning_content is None
    assert message.content == "Paris is the capital of France."
    assert not message.has_tool_calls


def test_tool_call_inside_reasoning_ends_the_reasoning() -> None:
    output = (
        f'I need the weather.\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
        f"{_parameter('city', 'Paris', True)}\n</{DSML}invoke>\n</{DSML}tool_calls>"
    )
    message = parse_every_way(output, thinking=True, **DEEPSEEK)

    assert message.reasoning_content == "I need the weather."
    assert message.content is None
    assert arguments_of(message) == [("get_weather", {"city": "Paris"})]


def test_output_cut_inside_the_second_call_keeps_only_the_first() -> None:
    cut = REALISTIC_OUTPUT.index("agent_id")
    message = parse_every_way(REALISTIC_OUTPUT[:cut], tools=TOOLS, thinking=True, **DEEPSEEK)

    assert [name for name, _ in arguments_of(message)] == ["write_file"]


def test_output_cut_inside_reasoning_gives_reasoning_only() -> None:
    message = parse_every_way(
        "Let me think about <this> carefully and </thi", thinking=True, **DEEPSEEK
    )

    assert message.reasoning_content == "Let me think about <this> carefully and"
    assert message.content is None
    assert not message.has_tool_calls


def test_dsml_deviations_seen_in_production_are_accepted() -> None:
    # `toolcalls` spelling, a parameter without `string`, an invoke closed only by the block end.
    output = (
        f'<{DSML}toolcalls>\n<{DSML}invoke name="search">\n'
        f'<{DSML}parameter name="limit">5</{DSML}parameter>\n'
        f'<{DSML}parameter name="query">plain words</{DSML}parameter>\n'
        f"</{DSML}tool_calls>"
    )
    message = parse_every_way(output, thinking=False, **DEEPSEEK)

    assert arguments_of(message) == [("search", {"limit": 5, "query": "plain words"})]


def test_invoke_without_block_and_text_after_the_calls() -> None:
    output = (
        f'Checking.\n<{DSML}invoke name="search">\n'
        f"{_parameter('query', 'x', True)}\n</{DSML}invoke>\n"
        "Trailing chatter the template never puts here."
    )
    message = parse_every_way(output, tools=TOOLS, thinking=False, **DEEPSEEK)

    assert message.content == "Checking."
    assert arguments_of(message) == [("search", {"query": "x"})]


def test_nothing_after_end_of_sentence_is_parsed() -> None:
    message = parse_every_way(
        f"Done.{DEEPSEEK_EOS}<{DSML}tool_calls>junk", thinking=False, **DEEPSEEK
    )

    assert message.content == "Done."
    assert not message.has_tool_calls


def _load_vllm_encoder() -> ModuleType:
    """vLLM's DeepSeek-V4 encoder file, loaded on its own (it needs only the standard library)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    path = (
        Path(next(iter(spec.submodule_search_locations))) / "tokenizers" / "deepseek_v4_encoding.py"
    )
    if not path.exists():
        pytest.skip(f"this vllm has no {path.name}")
    module_spec = importlib.util.spec_from_file_location("vllm_deepseek_v4_encoding", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("thinking_mode", ["thinking", "chat"])
def test_assistant_turns_rendered_by_vllm_encoder_parse_back(thinking_mode: str) -> None:
    encoder = _load_vllm_encoder()
    arguments = [
        {"path": "src/compare.py", "content": PYTHON_SOURCE, "overwrite": True, "mode": None},
        {
            "query": 'compare <T> in "src"',
            "agent_id": "007",
            "limit": 3,
            "filters": {"lang": "python", "nested": {"a": [1, 2.5, None]}},
            "tags": ["x"],
            "min_score": 0.5,
        },
    ]
    assistant = {
        "role": "assistant",
        "reasoning": 'Two tools are needed: <write_file> then "search".',
        "content": "Writing and searching now.",
        "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for name, args in zip(["write_file", "search"], arguments, strict=True)
        ],
    }
    conversation = [
        {"role": "system", "content": "You are a coding agent.", "tools": TOOLS},
        {"role": "user", "content": "Write the file, then search."},
    ]
    prompt = encoder.encode_messages(conversation, thinking_mode=thinking_mode)
    full = encoder.encode_messages([*conversation, assistant], thinking_mode=thinking_mode)
    assert full.startswith(prompt)
    is_thinking = thinking_mode == "thinking"
    assert prompt.endswith("<think>" if is_thinking else "</think>")

    message = parse_every_way(full[len(prompt) :], tools=TOOLS, thinking=is_thinking, **DEEPSEEK)

    assert message.reasoning_content == (assistant["reasoning"] if is_thinking else None)
    assert message.content == assistant["content"]
    assert arguments_of(message) == list(zip(["write_file", "search"], arguments, strict=True))


def test_an_invoke_missing_its_closing_tag_ends_where_the_next_invoke_begins() -> None:
    output = (
        f'<{DSML}tool_calls>\n<{DSML}invoke name="write_file">\n'
        f"{_parameter('path', 'a.txt', True)}\n"
        f'<{DSML}invoke name="search">\n'
        f"{_parameter('query', 'b', True)}\n</{DSML}invoke>\n</{DSML}tool_calls>"
    )
    message = parse_every_way(output, tools=TOOLS, thinking=False, **DEEPSEEK)

    # Was one write_file call holding both calls' parameters (vLLM's parser merges them too).
    assert arguments_of(message) == [("write_file", {"path": "a.txt"}), ("search", {"query": "b"})]



def _single_search_call(parameters: str) -> str:
    return (
        f'<{DSML}tool_calls>\n<{DSML}invoke name="search">\n{parameters}\n'
        f"</{DSML}invoke>\n</{DSML}tool_calls>"
    )


def test_a_lone_surrogate_escape_in_an_argument_still_gives_a_sendable_message() -> None:
    filters = '{"emoji": "\\ud83d", "pair": "\\ud83d\\ude00"}'
    output = _single_search_call(_parameter("filters", filters, False))
    message = parse_every_way(output, tools=TOOLS, thinking=False, **DEEPSEEK)

    # The gateway sends the message as UTF-8 JSON; this raised UnicodeEncodeError (a 500).
    json.dumps(message.to_dict(), ensure_ascii=False).encode("utf-8")
    assert arguments_of(message) == [("search", {"filters": {"emoji": "\ud83d", "pair": "😀"}})]


def test_arguments_wrapped_in_an_arguments_parameter_are_unwrapped_as_vllm_does() -> None:
    wrapped = '{"query": "cats", "limit": "3"}'
    output = _single_search_call(_parameter("arguments", wrapped, False))
    message = parse_every_way(output, tools=TOOLS, thinking=False, **DEEPSEEK)

    assert arguments_of(message) == [("search", {"query": "cats", "limit": 3})]
