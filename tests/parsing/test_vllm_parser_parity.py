"""Our parsers against vLLM's own (where vllm is installed): same calls, same typed arguments.

vLLM's parser classes take a tokenizer only to look special tokens up in its vocabulary (a
shortcut when token ids are given); these tests give them a tokenizer with an empty vocabulary,
so vLLM parses from the text alone, as ours does. Text fields are compared without their outer
whitespace, which ours trims by design. Importing vLLM takes tens of seconds on 2 cores, so the
corpus is parsed in one test per family.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.parsing import AssistantMessage, parse_output
from tests.parsing import test_deepseek_v4_parsing as deepseek_cases
from tests.parsing import test_glm47_parsing as glm_cases
from tests.parsing import test_qwen3_xml_parsing as qwen_cases
from tests.parsing.model_outputs import (
    DSML,
    ExpectedCall,
    ExpectedMessage,
    render_output,
    tools_for,
)
from tests.parsing.streaming_harness import stream
from tests.parsing.test_parser_parity_gaps import (
    CALLS_CUT_INSIDE_AN_ARGUMENT,
    CALLS_FROM_THE_REASONING,
    REASONING_ABOUT_MARKUP,
    UNCLOSED_CALLS,
    WRITE_TOOL,
    render_note_call,
)

vllm_parsers = {
    "deepseek_v4": pytest.importorskip("vllm.parser.deepseek_v4").DeepSeekV4Parser,
    "glm47": pytest.importorskip("vllm.parser.glm47_moe").Glm47MoeParser,
    "qwen3_xml": pytest.importorskip("vllm.parser.qwen3").Qwen3Parser,
}
ChatCompletionRequest = pytest.importorskip(
    "vllm.entrypoints.openai.chat_completion.protocol"
).ChatCompletionRequest

REASONING_PARSER_OF = {"deepseek_v4": "deepseek_v4", "glm47": "glm45", "qwen3_xml": "qwen3"}
THINKING_KWARGS = {
    "deepseek_v4": "thinking",
    "glm47": "enable_thinking",
    "qwen3_xml": "enable_thinking",
}


class EmptyVocabularyTokenizer:
    """Stands in for the model tokenizer, which vLLM's parsers only ask for its vocabulary."""

    def get_vocab(self) -> dict[str, int]:
        return {}


Comparable = tuple[str, str, list[tuple[str, Any]]]


def _vllm_parser(family: str, tools: list[dict[str, Any]]) -> tuple[Any, Any]:
    kwargs = {THINKING_KWARGS[family]: True}
    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        tools=tools or None,
        chat_template_kwargs=kwargs,
    )
    parser = vllm_parsers[family](
        EmptyVocabularyTokenizer(), tools=request.tools, chat_template_kwargs=kwargs
    )
    return parser, request


def _vllm_parse(family: str, text: str, tools: list[dict[str, Any]]) -> Comparable:
    parser, request = _vllm_parser(family, tools)
    reasoning, content, calls = parser.parse(text, request, enable_auto_tools=True)
    return (
        (reasoning or "").strip(),
        (content or "").strip(),
        [(call.name, json.loads(call.arguments)) for call in calls or []],
    )


def _comparable(message: AssistantMessage) -> Comparable:
    return (
        (message.reasoning_content or "").strip(),
        (message.content or "").strip(),
        [(call.name, json.loads(call.arguments)) for call in message.tool_calls],
    )


def _vllm_streamed(family: str, text: str, tools: list[dict[str, Any]]) -> Comparable:
    """What a client accumulates from vLLM's stream of `text`, fed a character at a time."""
    parser, request = _vllm_parser(family, tools)
    reasoning, content = "", ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for position, character in enumerate(text):
        delta = parser.parse_delta(
            character, [], request, finished=position == len(text) - 1
        )
        if delta is None:
            continue
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for entry in delta.tool_calls or []:
            names[entry.index] = names.get(entry.index, "") + (entry.function.name or "")
            arguments[entry.index] = arguments.get(entry.index, "") + (
                entry.function.arguments or ""
            )
    calls = [(names[index], json.loads(arguments[index])) for index in sorted(names)]
    return reasoning.strip(), content.strip(), calls


def _ours(
    family: str, text: str, tools: list[dict[str, Any]], *, model_stopped: bool = False
) -> AssistantMessage:
    return parse_output(
        text,
        tool_call_parser=family,
        reasoning_parser=REASONING_PARSER_OF[family],
        tools=tools,
        thinking=True,
        model_stopped=model_stopped,
    )


def _corpus(family: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """The realistic outputs of the per-family tests plus generated ones (thinking mode)."""
    realistic = {
        "deepseek_v4": (deepseek_cases.REALISTIC_OUTPUT, deepseek_cases.TOOLS),
        "glm47": (glm_cases.REALISTIC_OUTPUT.removeprefix("<think>"), glm_cases.TOOLS),
        "qwen3_xml": (qwen_cases.REALISTIC_OUTPUT, qwen_cases.TOOLS),
    }[family]
    generated = []
    for index, arguments in enumerate(GENERATED_ARGUMENTS):
        message = ExpectedMessage(
            reasoning=f'Step {index}: check <input> and "quotes".',
            content=f"Calling tool {index}." if index % 2 else None,
            calls=(ExpectedCall(f"tool_{index}", arguments), ExpectedCall("ping", {})),
        )
        generated.append(
            (render_output(family, message, think_style="prompt_opened"), tools_for(message.calls))
        )
    return [realistic, *generated]


GENERATED_ARGUMENTS: list[dict[str, Any]] = [
    {"path": "a/b.txt", "text": 'line 1\nline "2" <x/>\n', "count": 2, "ratio": 0.75},
    {"flag": False, "nothing": None, "items": [1, "two", {"three": 3}], "id": "007"},
    {"nested": {"a": {"b": [True, None, -1.5e-3]}}, "empty_list": [], "empty_text": ""},
    {"code": "if (a < b && c > d) { return '<ok>'; }", "n": -42},
]


@pytest.mark.parametrize("family", sorted(vllm_parsers))
def test_same_message_as_vllm_parser(family: str) -> None:
    for text, tools in _corpus(family):
        assert _comparable(_ours(family, text, tools)) == _vllm_parse(family, text, tools), text


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


_QUIRK_TOOLS = [
    _tool("search", {"query": {"type": "string"}, "limit": {"type": "integer"}}),
    _tool("note", {
        "title": {"type": "str"}, "n": {"type": "int"}, "ratio": {"type": "float"},
        "flag": {"type": "bool"}, "meta": {"type": "dict"}, "tags": {"type": "list"},
        "limit": {"type": ["Integer", "null"]}, "free": {"description": "any"}}),
    _tool("toggle", {"on": {"type": "boolean"}, "force": {"type": "boolean"}}),
    _tool("write", {"path": {"type": "string"}, "text": {"type": "string"}}),
    _tool("order", {"items": {"type": "array", "items": {"type": "object", "properties": {
        "qty": {"type": "integer"}, "sku": {"type": "string"}}}}}),
]
# Python-style type names, a parameter declared without a type (`free`) and one not declared at
# all (`extra`): vLLM types the first by the name and keeps the text of the others unless the
# markup marks it as JSON (DSML without string="true"). Where DSML marks `free` as JSON, vLLM
# turns a scalar back into text ("42"); ours keeps what the model wrote (42), so DSML leaves it
# out here.
_NOTE_ARGUMENTS = {
    "title": "123", "n": "007", "ratio": "0.5", "flag": "1", "meta": '{"a": [1, "b"]}',
    "tags": "[1, 2]", "limit": "null", "extra": "true",
}
_NOTE_CALLS = {
    "deepseek_v4": [
        render_note_call("deepseek_v4", _NOTE_ARGUMENTS, attribute)
        for attribute in (None, "true", "false")
    ],
    "glm47": [render_note_call("glm47", _NOTE_ARGUMENTS | {"free": "42"}, None)],
    "qwen3_xml": [render_note_call("qwen3_xml", _NOTE_ARGUMENTS | {"free": "42"}, None)],
}
QUIRKS: dict[str, list[str]] = {
    "deepseek_v4": [
        # Whole arguments object inside one undeclared `arguments` parameter.
        f'Look it up.</think><{DSML}tool_calls>\n<{DSML}invoke name="search">\n'
        f'<{DSML}parameter name="arguments" string="false">{{"query": "cats", "limit": 3}}'
        f"</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>",
        # Members of an array of objects written with the wrong JSON types.
        f'Order.</think><{DSML}tool_calls>\n<{DSML}invoke name="order">\n'
        f'<{DSML}parameter name="items" string="false">[{{"qty": "2", "sku": 7}}]'
        f"</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>",
        *_NOTE_CALLS["deepseek_v4"],
    ],
    "glm47": [
        # A tool the request did not declare, then one it did.
        "Go.</think><tool_call>fetch<arg_key>url</arg_key><arg_value>x</arg_value></tool_call>"
        "<tool_call>toggle<arg_key>on</arg_key><arg_value>1</arg_value></tool_call>",
        *_NOTE_CALLS["glm47"],
    ],
    "qwen3_xml": [
        # 1 and 0 for booleans.
        "Go.</think><tool_call>\n<function=toggle>\n<parameter=on>\n1\n</parameter>\n"
        "<parameter=force>\n0\n</parameter>\n</function>\n</tool_call>",
        # A file that quotes the tool-call tags.
        "Go.</think><tool_call>\n<function=write>\n<parameter=path>\na.md\n</parameter>\n"
        "<parameter=text>\nCalls end with </tool_call> and start with <tool_call>.\n</parameter>\n"
        "</function>\n</tool_call>",
        *_NOTE_CALLS["qwen3_xml"],
    ],
}


@pytest.mark.parametrize("family", sorted(vllm_parsers))
def test_same_typed_calls_as_vllm_on_model_quirks(family: str) -> None:
    # Compared as JSON text: 1 == True in Python, not to a client's schema.
    for text in QUIRKS[family]:
        ours = json.dumps(_comparable(_ours(family, text, _QUIRK_TOOLS)))
        assert ours == json.dumps(_vllm_parse(family, text, _QUIRK_TOOLS)), text


@pytest.mark.parametrize("family", sorted(vllm_parsers))
def test_same_calls_as_vllm_when_the_model_stops_before_a_closing_tag(family: str) -> None:
    # finish_reason "stop" (EOS, a stop string) right after the last argument.
    for text in UNCLOSED_CALLS[family]:
        expected = _vllm_parse(family, text, WRITE_TOOL)
        assert expected[2], text  # vLLM releases the call
        ours = _ours(family, text, WRITE_TOOL, model_stopped=True)
        assert _comparable(ours) == expected, text
        _, streamed = stream(
            list(text),
            model_stopped=True,
            tool_call_parser=family,
            reasoning_parser=REASONING_PARSER_OF[family],
            tools=WRITE_TOOL,
            thinking=True,
        )
        streamed_calls = [(call.name, json.loads(call.arguments)) for call in streamed.tool_calls]
        assert streamed_calls == _vllm_streamed(family, text, WRITE_TOOL)[2], text


@pytest.mark.parametrize("family", sorted(vllm_parsers))
def test_unlike_vllm_a_call_cut_inside_an_argument_is_not_sent(family: str) -> None:
    # vLLM sends it without the cut argument (streamed: with a prefix of it, not always JSON),
    # whether max_tokens or the model ended the output; ours sends nothing either way.
    for text in CALLS_CUT_INSIDE_AN_ARGUMENT[family]:
        [(name, arguments)] = _vllm_parse(family, text, WRITE_TOOL)[2]
        assert name == "write" and len(arguments) < 2, text  # the cut argument left out
        assert _ours(family, text, WRITE_TOOL, model_stopped=True).tool_calls == [], text


@pytest.mark.parametrize("family", sorted(vllm_parsers))
def test_tool_markup_inside_the_reasoning_as_vllm_reads_it(family: str) -> None:
    # Only the wrapper of the calls ends the reasoning; other markup is the reasoning's text.
    texts = [
        *(f"{reasoning}</think>\n\nAnswer." for reasoning in REASONING_ABOUT_MARKUP[family]),
        CALLS_FROM_THE_REASONING[family],
    ]
    for text in texts:
        expected = _vllm_parse(family, text, WRITE_TOOL)
        assert _comparable(_ours(family, text, WRITE_TOOL)) == expected, text
        assert _vllm_streamed(family, text, WRITE_TOOL) == expected, text
        _, streamed = stream(
            list(text),
            tool_call_parser=family,
            reasoning_parser=REASONING_PARSER_OF[family],
            tools=WRITE_TOOL,
            thinking=True,
        )
        assert _comparable(streamed) == expected, text


# The template's form: a newline on each side of each block's text.
_TWO_BLOCKS_ON_THEIR_OWN_LINES = (
    "<think>\nPlan.\n</think>\n\n<think>\nMore plan.\n</think>\n\nAnswer."
)


@pytest.mark.parametrize("family", ["deepseek_v4", "glm47"])
def test_two_reasoning_blocks_on_their_own_lines_as_vllm_joins_them(family: str) -> None:
    # vLLM's whole parse keeps the blocks' newlines: a paragraph between them. (Its stream
    # strips the first block's trailing newline: "Plan.\nMore plan.")
    expected = _vllm_parse(family, _TWO_BLOCKS_ON_THEIR_OWN_LINES, [])
    assert expected == ("Plan.\n\nMore plan.", "Answer.", [])
    assert _comparable(_ours(family, _TWO_BLOCKS_ON_THEIR_OWN_LINES, [])) == expected


@pytest.mark.parametrize("family", sorted(vllm_parsers))
def test_unlike_vllm_two_reasoning_blocks_are_always_a_paragraph_apart(family: str) -> None:
    # vLLM joins blocks written without newlines into one word ("ab"), or, in qwen3, makes the
    # second block content, its `<think>` tag included; ours keeps both as reasoning, apart.
    text = "a</think>\n\n<think>b</think>answer"
    vllm_reasoning, vllm_content, _ = _vllm_parse(family, text, [])
    if family == "qwen3_xml":
        assert (vllm_reasoning, vllm_content) == ("a", "<think>banswer")
    else:
        assert (vllm_reasoning, vllm_content) == ("ab", "answer")
    assert _comparable(_ours(family, text, [])) == ("a\n\nb", "answer", [])
