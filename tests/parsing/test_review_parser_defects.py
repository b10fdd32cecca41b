"""Defects found reviewing the parsers against vLLM's own (each test failed before its fix)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.parsing.argument_typing import type_value
from services.gateway.parsing.forced_tool_calls import ForcedToolChoice
from services.gateway.reasoning_tokens import ReasoningMarkerIds, ReasoningTokenCounter
from tests.parsing.model_outputs import BAR, DSML
from tests.parsing.streaming_harness import arguments_of, parse_every_way

QWEN = {"tool_call_parser": "qwen3_xml", "reasoning_parser": "qwen3"}
DEEPSEEK = {"tool_call_parser": "deepseek_v4", "reasoning_parser": "deepseek_v4"}


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WRITE_TOOLS = [_tool("write_file", {"path": {"type": "string"}, "text": {"type": "string"}})]
# A file an agent writes about the Qwen3 format itself: the tool-call tags are its text.
DOC_TEXT = (
    "Each call ends with </tool_call>.\nSee <tool_call> in 文档 🎉 and </tool_call> again."
)


def _qwen3_call(name: str, parameters: dict[str, str]) -> str:
    body = "".join(
        f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items()
    )
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_tool_call_tags_inside_a_parameter_value_are_the_value_text() -> None:
    # The value was cut at its first `</tool_call>` and the rest of the call dropped: the file
    # written held "Each call ends with". vLLM's qwen3 parser keeps the whole value.
    output = (
        "Write the doc.</think>\n\n"
        + _qwen3_call("write_file", {"path": "docs/qwen.md", "text": DOC_TEXT})
        + "\n"
        + _qwen3_call("write_file", {"path": "b.md", "text": "second"})
        + "<|im_end|>"
    )
    message = parse_every_way(output, tools=WRITE_TOOLS, thinking=True, **QWEN)

    assert arguments_of(message) == [
        ("write_file", {"path": "docs/qwen.md", "text": DOC_TEXT}),
        ("write_file", {"path": "b.md", "text": "second"}),
    ]


def test_qwen3_tool_call_end_still_closes_a_call_missing_its_function_end() -> None:
    # Outside a parameter value `</tool_call>` keeps ending a call that lacks `</function>`.
    output = (
        "<tool_call>\n<function=write_file>\n<parameter=path>\na.md\n</parameter>\n</tool_call>"
        "\n<tool_call>\n<function=write_file>\n<parameter=path>\nb.md\n</parameter>\n</tool_call>"
    )
    message = parse_every_way(output, tools=WRITE_TOOLS, thinking=False, **QWEN)

    assert arguments_of(message) == [
        ("write_file", {"path": "a.md"}),
        ("write_file", {"path": "b.md"}),
    ]


ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "quantity": {"type": "integer"},
        "express": {"type": "boolean"},
        "sku": {"type": "string"},
        "address": {
            "anyOf": [
                {"type": "object", "properties": {"zip": {"type": "integer"}}},
                {"type": "null"},
            ]
        },
    },
}
ORDER_TOOLS = [
    _tool(
        "place_orders",
        {
            "orders": {"type": "array", "items": ORDER_SCHEMA},
            "ids": {"type": "array", "items": {"type": "integer"}},
            "weights": {"type": "object", "properties": {"max": {"type": "number"}}},
        },
    )
]
# Numbers and booleans written as strings inside objects and arrays, as models write them.
ORDERS_AS_WRITTEN = (
    '[{"quantity": "2", "express": "true", "sku": "007", "address": {"zip": "75001"}, '
    '"note": "12"}, {"quantity": 3, "express": false, "sku": 7, "address": null}]'
)
ORDERS_TYPED = [
    {"quantity": 2, "express": True, "sku": "007", "address": {"zip": 75001}, "note": "12"},
    {"quantity": 3, "express": False, "sku": "7", "address": None},
]


def test_dsml_members_of_objects_and_arrays_are_typed_by_the_nested_schema() -> None:
    # vLLM's deepseek_v4 parser types nested members by the schema's `properties` and `items`
    # (not through `anyOf`); ours left {"quantity": "2"} a string where the schema says integer.
    parameters = "\n".join(
        f'<{DSML}parameter name="{name}" string="false">{value}</{DSML}parameter>'
        for name, value in (
            ("orders", ORDERS_AS_WRITTEN),
            ("ids", '["1", 2, "x"]'),
            ("weights", '{"max": "2.5"}'),
        )
    )
    output = (
        f'Order.</think><{DSML}tool_calls>\n<{DSML}invoke name="place_orders">\n{parameters}\n'
        f"</{DSML}invoke>\n</{DSML}tool_calls>"
    )
    message = parse_every_way(output, tools=ORDER_TOOLS, thinking=True, **DEEPSEEK)

    assert arguments_of(message) == [
        ("place_orders", {"orders": ORDERS_TYPED, "ids": [1, 2, "x"], "weights": {"max": 2.5}})
    ]


def test_qwen3_members_of_objects_and_arrays_are_typed_the_same_way() -> None:
    output = _qwen3_call("place_orders", {"orders": ORDERS_AS_WRITTEN, "ids": "['4', 5]"})
    message = parse_every_way(output, tools=ORDER_TOOLS, thinking=False, **QWEN)

    assert arguments_of(message) == [("place_orders", {"orders": ORDERS_TYPED, "ids": [4, 5]})]


def test_nested_typing_leaves_members_the_schema_does_not_describe() -> None:
    schema = {"type": "object", "properties": {"meta": {"type": "object"}, "n": {}}}
    value = type_value('{"meta": {"a": "1"}, "n": "2", "extra": "3"}', "json", schema)

    assert value == {"meta": {"a": "1"}, "n": "2", "extra": "3"}


def _defined_tool(name: str, keyword: str, item_properties: dict[str, Any]) -> dict[str, Any]:
    """A tool whose parameters refer to a definition, as pydantic (`$defs`) and zod-to-json-schema
    (`definitions`) write nested models."""
    parameters = {
        "type": "object",
        "properties": {"item": {"$ref": f"#/{keyword}/Item"}},
        "required": ["item"],
        keyword: {"Item": {"type": "object", "properties": item_properties, "required": ["sku"]}},
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_required_tool_choice_schema_keeps_each_tools_definitions_reachable() -> None:
    # Each tool's `#/$defs/...` reference was left pointing at the root of the array schema,
    # which has no `$defs`: xgrammar (vLLM's structured-output backend) refused to compile it,
    # so tool_choice "required" failed for any tool with a nested model. vLLM hoists `$defs`.
    xgrammar = pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    tools = [
        _defined_tool("add_book", "$defs", {"sku": {"type": "string"}}),
        # The same definition name with another schema: both must stay distinct.
        _defined_tool("add_part", "$defs", {"sku": {"type": "integer"}}),
        _defined_tool("add_note", "definitions", {"sku": {"type": "boolean"}}),
    ]
    choice = ForcedToolChoice.of(tools, "required", None)
    assert choice is not None
    schema = choice.json_schema()

    xgrammar.Grammar.from_json_schema(json.dumps(schema))
    validator = jsonschema.Draft202012Validator(schema)
    good = [
        {"name": "add_book", "parameters": {"item": {"sku": "b-1"}}},
        {"name": "add_part", "parameters": {"item": {"sku": 7}}},
        {"name": "add_note", "parameters": {"item": {"sku": True}}},
    ]
    assert validator.is_valid(good)
    for name, wrong_sku in (("add_book", 7), ("add_part", "p-7"), ("add_note", "yes")):
        assert not validator.is_valid([{"name": name, "parameters": {"item": {"sku": wrong_sku}}}])
    # The request's own tools are left as they were.
    assert "$defs" in tools[0]["function"]["parameters"]
    assert tools[1]["function"]["parameters"]["properties"]["item"] == {"$ref": "#/$defs/Item"}


ANSWER_ABOUT_TAGS = "Reasoning models wrap their thoughts in <think> and </think> tags; then answer."


def test_a_think_tag_the_answer_talks_about_stays_in_the_content() -> None:
    # The `<think>` opened a second reasoning block: the rest of the answer went to
    # reasoning_content, so a client showing content read "Reasoning models wrap their thoughts
    # in". vLLM's qwen3 parser keeps it as content.
    for family, options, end in (
        ("qwen3_xml", QWEN, "<|im_end|>"),
        ("deepseek_v4", DEEPSEEK, f"<{BAR}end\u2581of\u2581sentence{BAR}>"),
    ):
        output = f"The user asks about tags.\n</think>\n\n{ANSWER_ABOUT_TAGS}{end}"
        message = parse_every_way(output, tools=WRITE_TOOLS, thinking=True, **options)

        assert message.reasoning_content == "The user asks about tags.", family
        content = message.content or ""
        assert content.startswith("Reasoning models wrap their thoughts in <think> and"), family
        # The closing tag is still dropped, as vLLM drops it: it cannot be told from a misplaced one.
        assert content.endswith(" tags; then answer."), family


def test_a_think_tag_before_any_content_still_opens_the_reasoning() -> None:
    for thinking in (False, True):
        output = "<think>\nPlan.\n</think>\n\n<think>\nMore plan.\n</think>\n\nAnswer."
        message = parse_every_way(output, thinking=thinking, **QWEN)

        assert message.content == "Answer."
        reasoning = message.reasoning_content or ""
        assert reasoning.startswith("Plan.") and reasoning.endswith("More plan.")


def test_closing_tags_the_answer_talks_about_stay_in_the_content() -> None:
    # Each was dropped: "Close a call with  and  then." vLLM keeps them as content.
    for family, options, answer in (
        ("qwen3_xml", QWEN, "Close a call with </function> and </tool_call>, then stop."),
        ("glm47", {"tool_call_parser": "glm47", "reasoning_parser": "glm45"},
         "Close a call with </tool_call>, then stop."),
    ):
        message = parse_every_way(f"Explain.</think>\n\n{answer}", thinking=True, **options)

        assert (message.reasoning_content, message.content) == ("Explain.", answer), family


def test_a_stray_closing_tag_before_the_answer_is_still_dropped() -> None:
    message = parse_every_way("</tool_call>\n</function>\nHello.", thinking=False, **QWEN)

    assert message.content == "Hello."


def test_reasoning_tokens_stop_at_the_end_of_the_reasoning_though_the_answer_writes_think() -> None:
    # An answer that writes the `<think>` token was counted as reasoning to its end, while the
    # output parser (above) keeps it as content.
    start, end = 7, 8
    counter = ReasoningTokenCounter(ReasoningMarkerIds(start, end), thinking=True)

    assert counter.feed([1, 2, end, 3, start, 4, 5]) == 2
