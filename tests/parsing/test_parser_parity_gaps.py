"""Where our parsers met vLLM 0.32's on review: calls the model ended without their closing tag,
parameters the schema does not type, Python-style type names, tool markup inside the reasoning
and two reasoning blocks (`test_vllm_parser_parity` compares these outputs with vLLM's own
parsers)."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway.generation import ChoiceDelta
from services.gateway.parsing import ChatOutputParser, parse_output
from services.gateway.routes.chat import parse_choice_delta
from tests.parsing.model_outputs import DSML, END_OF_TURN, FAMILIES, REASONING_PARSER_OF
from tests.parsing.streaming_harness import arguments_of, parse_every_way, stream


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WRITE_TOOL = [_tool("write", {"path": {"type": "string"}, "n": {"type": "integer"}})]
_P, _PE = f"<{DSML}parameter", f"</{DSML}parameter>"
_DSML_CALL_HEAD = f'Go.</think>\n\n<{DSML}tool_calls>\n<{DSML}invoke name="write">\n'

# Calls whole but for their closing tags, as a model that stops early (or a stop string) leaves
# them; vLLM releases each of these as write(path="a.txt", n=3).
UNCLOSED_CALLS: dict[str, list[str]] = {
    "deepseek_v4": [
        f'{_DSML_CALL_HEAD}{_P} name="path" string="true">a.txt{_PE}\n'
        f'{_P} name="n" string="false">3{_PE}\n',
        # Without the block, as the model sometimes writes an invoke.
        f'Go.</think>\n\n<{DSML}invoke name="write">\n{_P} name="path" string="true">a.txt{_PE}'
        f'{_P} name="n" string="false">3{_PE}',
    ],
    "glm47": [
        "Go.</think><tool_call>write<arg_key>path</arg_key><arg_value>a.txt</arg_value>"
        "<arg_key>n</arg_key><arg_value>3</arg_value>",
        "Go.</think><tool_call>write\n<arg_key>path</arg_key>\n<arg_value>a.txt</arg_value>\n"
        "<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n",
    ],
    "qwen3_xml": [
        "Go.</think>\n\n<tool_call>\n<function=write>\n<parameter=path>\na.txt\n</parameter>\n"
        "<parameter=n>\n3\n</parameter>\n",
    ],
}
# The same calls cut off inside their last argument: vLLM sends the call without that argument
# (and, streamed, arguments that are not even JSON); a client could execute it half-written.
CALLS_CUT_INSIDE_AN_ARGUMENT: dict[str, list[str]] = {
    "deepseek_v4": [
        f'{_DSML_CALL_HEAD}{_P} name="path" string="true">a.txt{_PE}\n'
        f'{_P} name="n" string="false">3',
        f'{_DSML_CALL_HEAD}{_P} name="n" string="false">3{_PE}\n{_P} name="path" string="true">a.t',
        f'{_DSML_CALL_HEAD}{_P} name="n" string="false">3{_PE}\n{_P} name="pa',
    ],
    "glm47": [
        "Go.</think><tool_call>write<arg_key>n</arg_key><arg_value>3</arg_value>"
        "<arg_key>path</arg_key><arg_value>a.t",
        "Go.</think><tool_call>write<arg_key>n</arg_key><arg_value>3</arg_value><arg_key>pa",
        "Go.</think><tool_call>write<arg_key>n</arg_key><arg_value>3</arg_value>"
        "<arg_key>path</arg_key>",
    ],
    "qwen3_xml": [
        "Go.</think>\n\n<tool_call>\n<function=write>\n<parameter=n>\n3\n</parameter>\n"
        "<parameter=path>\na.t",
        "Go.</think>\n\n<tool_call>\n<function=write>\n<parameter=path>\na.txt\n</parameter>\n"
        "<parameter=n>\n3\n</param",
    ],
}


def _options(family: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tool_call_parser": family,
        "reasoning_parser": REASONING_PARSER_OF[family],
        "tools": tools,
        "thinking": True,
    }


def _unclosed_cases() -> list[tuple[str, str]]:
    return [(family, text) for family, texts in UNCLOSED_CALLS.items() for text in texts]


def _cut_cases() -> list[tuple[str, str]]:
    return [
        (family, text) for family, texts in CALLS_CUT_INSIDE_AN_ARGUMENT.items() for text in texts
    ]


@pytest.mark.parametrize(("family", "text"), _unclosed_cases())
def test_a_call_the_model_ended_without_its_closing_tag_is_released(
    family: str, text: str
) -> None:
    message = parse_every_way(text, model_stopped=True, **_options(family, WRITE_TOOL))

    assert arguments_of(message) == [("write", {"path": "a.txt", "n": 3})]


@pytest.mark.parametrize(("family", "text"), _unclosed_cases())
def test_the_same_call_cut_off_by_max_tokens_is_not_sent(family: str, text: str) -> None:
    # finish_reason "length": the call may have had more arguments to come.
    message = parse_every_way(text, model_stopped=False, **_options(family, WRITE_TOOL))

    assert message.tool_calls == []


@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_the_chat_route_tells_the_parser_whether_the_model_stopped(finish_reason: str) -> None:
    """The last delta's finish_reason decides: "stop" releases the unclosed call."""
    family, text = _unclosed_cases()[0]
    options = _options(family, WRITE_TOOL)
    parser = ChatOutputParser(options["tool_call_parser"], options["reasoning_parser"], WRITE_TOOL,
                              thinking=True)
    released = parse_choice_delta(parser, ChoiceDelta(0, text, finish_reason=finish_reason))
    assert [call.name for call in released.tool_calls if call.name] == (
        ["write"] if finish_reason == "stop" else [])


@pytest.mark.parametrize(("family", "text"), _cut_cases())
@pytest.mark.parametrize("model_stopped", [True, False])
def test_a_call_ended_inside_an_argument_is_not_sent(
    family: str, text: str, model_stopped: bool
) -> None:
    message = parse_every_way(text, model_stopped=model_stopped, **_options(family, WRITE_TOOL))

    assert message.tool_calls == []
    assert message.content is None


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("deepseek_v4", f"{_DSML_CALL_HEAD}{_P} name=\"n\">3{_PE}\n"),
        ("glm47", "Go.</think><tool_call>write<arg_key>n</arg_key><arg_value>3</arg_value>"),
        (
            "qwen3_xml",
            "Go.</think>\n\n<tool_call>\n<function=write>\n<parameter=n>\n3\n</parameter>\n",
        ),
    ],
)
def test_a_terminator_ends_an_unclosed_call_as_the_end_of_the_output_does(
    family: str, text: str
) -> None:
    # With special tokens shown (or stops included), the end-of-turn token reaches the parser
    # before the output ends; whatever the finish reason, the model ended the turn there.
    message = parse_every_way(text + END_OF_TURN[family], **_options(family, WRITE_TOOL))

    assert arguments_of(message) == [("write", {"n": 3})]


def test_a_second_unclosed_call_follows_the_released_ones() -> None:
    text = (
        "Go.</think><tool_call>write<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>"
        "<tool_call>write<arg_key>n</arg_key><arg_value>2</arg_value>"
    )
    deltas, message = stream(list(text), model_stopped=True, **_options("glm47", WRITE_TOOL))

    assert arguments_of(message) == [("write", {"n": 1}), ("write", {"n": 2})]
    assert [entry.index for entry in deltas[-1].tool_calls] == [1, 1]  # released by finish
    assert message.tool_calls[0].id != message.tool_calls[1].id


def test_an_unclosed_call_is_not_released_when_tool_calls_are_off() -> None:
    text = UNCLOSED_CALLS["qwen3_xml"][0]
    message = parse_output(
        text, allow_tool_calls=False, model_stopped=True, **_options("qwen3_xml", WRITE_TOOL)
    )

    assert message.tool_calls == []
    assert message.content is None


def test_finish_releases_nothing_twice() -> None:
    parser = ChatOutputParser(**_options("glm47", WRITE_TOOL))
    parser.feed(UNCLOSED_CALLS["glm47"][0])

    assert len(parser.finish(model_stopped=True).tool_calls) == 2
    assert parser.finish(model_stopped=True).tool_calls == []
    assert len(parser.message().tool_calls) == 1


# Gap 2: parameters the schema does not type keep their text, as vLLM keeps them.

_VALUES = {"n": "123", "flag": "true", "nothing": "null", "items": "[1, 2]", "word": "hello"}


def render_note_call(family: str, arguments: dict[str, str], string_attribute: str | None) -> str:
    if family == "deepseek_v4":
        attribute = "" if string_attribute is None else f' string="{string_attribute}"'
        parameters = "".join(
            f'{_P} name="{key}"{attribute}>{value}{_PE}\n' for key, value in arguments.items()
        )
        return (
            f'Go.</think>\n\n<{DSML}tool_calls>\n<{DSML}invoke name="note">\n{parameters}'
            f"</{DSML}invoke>\n</{DSML}tool_calls>"
        )
    if family == "glm47":
        pairs = "".join(
            f"<arg_key>{key}</arg_key><arg_value>{value}</arg_value>"
            for key, value in arguments.items()
        )
        return f"Go.</think><tool_call>note{pairs}</tool_call>"
    parameters = "".join(
        f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items()
    )
    return f"Go.</think>\n\n<tool_call>\n<function=note>\n{parameters}</function>\n</tool_call>"


_UNTYPING_TOOLS = {
    "undeclared": [_tool("note", {"title": {"type": "string"}})],
    "no properties": [{"type": "function", "function": {"name": "note"}}],
    "declared without a type": [_tool("note", {key: {"description": key} for key in _VALUES})],
}


@pytest.mark.parametrize("family", ["glm47", "qwen3_xml"])
@pytest.mark.parametrize("tools", _UNTYPING_TOOLS.values(), ids=_UNTYPING_TOOLS.keys())
def test_untyped_parameters_keep_their_text(family: str, tools: list[dict[str, Any]]) -> None:
    message = parse_every_way(render_note_call(family, _VALUES, None), **_options(family, tools))

    assert arguments_of(message) == [("note", _VALUES)]


@pytest.mark.parametrize("tools", _UNTYPING_TOOLS.values(), ids=_UNTYPING_TOOLS.keys())
@pytest.mark.parametrize("string_attribute", ["false", None])
def test_untyped_dsml_parameters_written_as_json_are_read_as_json(
    tools: list[dict[str, Any]], string_attribute: str | None
) -> None:
    text = render_note_call("deepseek_v4", _VALUES, string_attribute)
    message = parse_every_way(text, **_options("deepseek_v4", tools))

    assert arguments_of(message) == [
        ("note", {"n": 123, "flag": True, "nothing": None, "items": [1, 2], "word": "hello"})
    ]


def test_untyped_dsml_parameters_written_as_text_keep_it() -> None:
    text = render_note_call("deepseek_v4", _VALUES, "true")
    message = parse_every_way(text, **_options("deepseek_v4", _UNTYPING_TOOLS["undeclared"]))

    assert arguments_of(message) == [("note", _VALUES)]


def test_a_dsml_parameter_without_string_attribute_is_read_as_json() -> None:
    # vLLM reads a missing attribute as string="false": a quoted value loses its quotes.
    tools = [_tool("note", {"title": {"type": "string"}, "n": {"type": "integer"}})]
    text = render_note_call("deepseek_v4", {"title": '"Hi"', "n": '"3"'}, None)
    message = parse_every_way(text, **_options("deepseek_v4", tools))

    assert arguments_of(message) == [("note", {"title": "Hi", "n": 3})]


# Gap 3: Python-style (and other) type names mean the JSON types, as vLLM maps them.

_PYTHON_TYPED_TOOL = [
    _tool(
        "note",
        {
            "title": {"type": "str"},
            "n": {"type": "int"},
            "ratio": {"type": "float"},
            "flag": {"type": "bool"},
            "meta": {"type": "dict", "properties": {"id": {"type": "str"}}},
            "tags": {"type": "list", "items": {"type": "Integer"}},
            "limit": {"type": ["int", "null"]},
            "size": {"type": "int64"},
            "label": {"type": "String"},
        },
    )
]
_PYTHON_TYPED_VALUES = {
    "title": "123",
    "n": "007",
    "ratio": ".5",
    "flag": "1",
    "meta": '{"id": 42}',
    "tags": '["1", 2]',
    "limit": "null",
    "size": "9",
    "label": "true",
}
_PYTHON_TYPED_ARGUMENTS = {
    "title": "123",
    "n": 7,
    "ratio": 0.5,
    "flag": True,
    "meta": {"id": "42"},
    "tags": [1, 2],
    "limit": None,
    "size": 9,
    "label": "true",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_python_style_type_names_type_the_values(family: str) -> None:
    text = render_note_call(family, _PYTHON_TYPED_VALUES, None)
    message = parse_every_way(text, **_options(family, _PYTHON_TYPED_TOOL))

    assert arguments_of(message) == [("note", _PYTHON_TYPED_ARGUMENTS)]


# Gap 4: tool markup inside the reasoning. Only the wrapper the templates put around calls
# (`<tool_call>`, the DSML block) ends the reasoning, as in vLLM's grammars; a bare call or a
# closing tag there is the reasoning's own text (the model planning a call, or thinking about
# the format), which vLLM keeps as reasoning.

_QWEN_CALL = "<function=write>\n<parameter=n>\n3\n</parameter>\n</function>"
_GLM_CALL = "write<arg_key>n</arg_key><arg_value>3</arg_value>"
_DSML_INVOKE = f'<{DSML}invoke name="write">\n{_P} name="n" string="false">3{_PE}\n</{DSML}invoke>'

REASONING_ABOUT_MARKUP: dict[str, list[str]] = {
    "deepseek_v4": [
        f"I could send {_DSML_INVOKE} but first check.",
        f"Calls close with </{DSML}invoke>, the block with </{DSML}tool_calls>.",
    ],
    "glm47": ["Calls close with </tool_call>, keys with </arg_key>."],
    "qwen3_xml": [
        f"I could send {_QWEN_CALL} but first check.",
        "Calls close with </function>, then </tool_call>.",
    ],
}
CALLS_FROM_THE_REASONING: dict[str, str] = {
    "deepseek_v4": f"Need it.\n\n<{DSML}tool_calls>\n{_DSML_INVOKE}\n</{DSML}tool_calls>",
    "glm47": f"Need it.<tool_call>{_GLM_CALL}</tool_call>",
    "qwen3_xml": f"Need it.\n<tool_call>\n{_QWEN_CALL}\n</tool_call>",
}


def _reasoning_about_markup_cases() -> list[tuple[str, str]]:
    return [(family, text) for family, texts in REASONING_ABOUT_MARKUP.items() for text in texts]


@pytest.mark.parametrize(("family", "reasoning"), _reasoning_about_markup_cases())
@pytest.mark.parametrize("thinking", [True, False])
def test_tool_markup_the_reasoning_writes_stays_in_the_reasoning(
    family: str, reasoning: str, thinking: bool
) -> None:
    # A bare `<function=...>` (or DSML invoke) started a call: the reasoning was cut at it, the
    # answer lost and the call sent; a closing tag was dropped from the reasoning's text.
    opening = "" if thinking else "<think>"
    text = f"{opening}{reasoning}</think>\n\nAnswer."
    message = parse_every_way(text, **_options(family, WRITE_TOOL) | {"thinking": thinking})

    assert (message.reasoning_content, message.content) == (reasoning, "Answer.")
    assert message.tool_calls == []


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tool_call_wrapper_still_ends_the_reasoning(family: str) -> None:
    message = parse_every_way(CALLS_FROM_THE_REASONING[family], **_options(family, WRITE_TOOL))

    assert (message.reasoning_content, message.content) == ("Need it.", None)
    assert arguments_of(message) == [("write", {"n": 3})]


# Gap 5: two reasoning blocks with only whitespace between them (the model closed its reasoning
# and opened another). Their texts were joined with nothing between ("ab"); they are one
# reasoning, a paragraph apart. vLLM joins them as written (glm45, deepseek_v4) or makes the
# second block content, `<think>` tag included (qwen3).

TWO_REASONING_BLOCKS: list[tuple[str, bool]] = [
    ("<think>a</think>\n\n<think>b</think>answer", False),
    ("<think>a</think>\n\n<think>b</think>answer", True),
    ("a</think>\n<think>b</think>answer", True),
    ("a</think><think>b</think>answer", True),
    ("<think>\na\n</think>\n\n<think>\nb\n</think>\n\nanswer", False),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("text", "thinking"), TWO_REASONING_BLOCKS)
def test_two_reasoning_blocks_are_two_paragraphs_of_the_reasoning(
    family: str, text: str, thinking: bool
) -> None:
    message = parse_every_way(text, **_options(family, WRITE_TOOL) | {"thinking": thinking})

    assert (message.reasoning_content, message.content) == ("a\n\nb", "answer")


@pytest.mark.parametrize(
    ("text", "reasoning"),
    [
        ("<think></think>\n<think>b</think>answer", "b"),
        ("<think>a</think>\n<think>\n</think>answer", "a"),
        ("<think>a</think>\n<think></think>\n<think>b</think>answer", "a\n\nb"),
    ],
)
def test_an_empty_reasoning_block_adds_no_separator(text: str, reasoning: str) -> None:
    message = parse_every_way(text, **_options("qwen3_xml", WRITE_TOOL) | {"thinking": False})

    assert (message.reasoning_content, message.content) == (reasoning, "answer")


def test_a_reasoning_block_after_a_tool_call_wrapper_in_the_reasoning_is_not_opened() -> None:
    # After the calls nothing is parsed but calls: a `<think>` there is no second block.
    text = CALLS_FROM_THE_REASONING["glm47"] + "<think>b</think>"
    message = parse_every_way(text, **_options("glm47", WRITE_TOOL))

    assert (message.reasoning_content, message.content) == ("Need it.", None)
