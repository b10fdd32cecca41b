"""The parsing package: parser names, errors, and staying light enough for the gateway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.gateway.parsing import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    ChatOutputParser,
    UnknownParserError,
)
from tests.parsing.model_outputs import (
    FAMILIES,
    REASONING_PARSER_OF,
    ExpectedCall,
    ExpectedMessage,
    render_output,
    tools_for,
)
from tests.parsing.streaming_harness import arguments_of, parse_every_way

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_parser_names_are_vllms() -> None:
    assert TOOL_CALL_PARSER_NAMES == ("deepseek_v4", "glm47", "qwen3_xml")
    assert REASONING_PARSER_NAMES == ("deepseek_v4", "glm45", "qwen3")


@pytest.mark.parametrize(
    "options", [{"tool_call_parser": "hermes"}, {"reasoning_parser": "deepseek_r1"}]
)
def test_unknown_parser_name_is_a_value_error(options: dict[str, str]) -> None:
    with pytest.raises(UnknownParserError, match="known:"):
        ChatOutputParser(**options)


def test_feed_after_finish_is_refused_and_finish_twice_is_harmless() -> None:
    parser = ChatOutputParser(reasoning_parser="qwen3")
    assert parser.feed("hi").content == "hi"
    assert parser.finish().is_empty
    assert parser.finish().is_empty
    with pytest.raises(RuntimeError):
        parser.feed("more")


def test_without_parsers_the_text_is_content_verbatim_apart_from_edges() -> None:
    parser = ChatOutputParser()
    text = "<think>not parsed</think> <tool_call>x</tool_call>"
    assert parser.feed(text).content == text
    assert parser.finish().is_empty


def test_tool_calls_not_allowed_are_consumed_but_not_released() -> None:
    output = "Sure.<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    parser = ChatOutputParser("glm47", "glm45", allow_tool_calls=False)
    deltas = [parser.feed(char) for char in output]
    deltas.append(parser.finish())

    assert parser.message().content == "Sure."
    assert not parser.has_tool_calls
    assert not any(delta.tool_calls for delta in deltas)


@pytest.mark.parametrize("family", FAMILIES)
def test_with_parallel_tool_calls_off_only_the_first_call_is_released(family: str) -> None:
    # vLLM keeps the call of index 0 whatever the tool_choice (`maybe_filter_parallel_tool_calls`).
    calls = (ExpectedCall("get_weather", {"city": "Paris"}), ExpectedCall("get_time", {}))
    output = render_output(
        family, ExpectedMessage(content="Two calls.", calls=calls), think_style="chat"
    )
    options = {
        "tool_call_parser": family,
        "reasoning_parser": REASONING_PARSER_OF[family],
        "tools": tools_for(calls),
    }

    message = parse_every_way(output, allow_parallel_tool_calls=False, **options)

    assert message.content == "Two calls."
    assert arguments_of(message) == [("get_weather", {"city": "Paris"})]
    assert len(parse_every_way(output, **options).tool_calls) == 2


def test_importing_the_parsers_pulls_in_no_torch_vllm_or_transformers() -> None:
    code = (
        "import sys, services.gateway.parsing, services.gateway.parsing.cli;"
        "heavy = sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('torch', 'vllm', 'transformers'));"
        "print(','.join(heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == ""
