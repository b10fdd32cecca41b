"""Argument values typed by the tool's JSON schema."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.parsing.argument_typing import (
    RawArgument,
    ToolSchemas,
    ValueEncoding,
    arguments_json,
    declared_types,
    type_value,
)

STRING = {"type": "string"}
INTEGER = {"type": "integer"}
NUMBER = {"type": "number"}
BOOLEAN = {"type": "boolean"}
OBJECT = {"type": "object"}
ARRAY = {"type": "array"}
NULLABLE_INTEGER = {"type": ["integer", "null"]}


@pytest.mark.parametrize(
    ("text", "encoding", "schema", "expected"),
    [
        ("007", "unknown", STRING, "007"),
        ("007", "json", STRING, "007"),
        ("true", "unknown", STRING, "true"),
        (' spaced "quoted" ', "text", STRING, ' spaced "quoted" '),
        ('"quoted"', "json", STRING, "quoted"),
        ("3", "unknown", INTEGER, 3),
        ("3", "text", INTEGER, 3),
        (" 3.0\n", "unknown", INTEGER, 3),
        ('"3"', "json", INTEGER, 3),
        ("three", "unknown", INTEGER, "three"),
        ("0003", "unknown", INTEGER, 3),
        ("+7", "text", INTEGER, 7),
        ("1_000", "unknown", INTEGER, "1_000"),
        ("9" * 5000, "unknown", INTEGER, "9" * 5000),
        (".5", "unknown", NUMBER, 0.5),
        ("007", "unknown", {"type": ["string", "integer"]}, 7),
        ("2.5", "unknown", NUMBER, 2.5),
        ("4", "json", NUMBER, 4),
        ("1e999", "unknown", NUMBER, "1e999"),
        ("NaN", "json", NUMBER, "NaN"),
        ("True", "unknown", BOOLEAN, True),
        ("1", "unknown", BOOLEAN, True),  # as vLLM reads it; was the integer 1
        ("0", "text", BOOLEAN, False),
        ("1", "unknown", {"type": ["integer", "boolean"]}, 1),
        ("false", "json", BOOLEAN, False),
        ("null", "unknown", NULLABLE_INTEGER, None),
        ("None", "unknown", NULLABLE_INTEGER, None),
        ("12", "unknown", NULLABLE_INTEGER, 12),
        ('{"a": [1, {"b": null}]}', "unknown", OBJECT, {"a": [1, {"b": None}]}),
        ("{'a': True, 'b': None}", "unknown", OBJECT, {"a": True, "b": None}),
        ("[1, 'x']", "unknown", ARRAY, [1, "x"]),
        ("[1, 2]", "unknown", OBJECT, [1, 2]),  # the wrong type, still read as JSON
        ("not json", "unknown", ARRAY, "not json"),
        # Without a type in the schema the text stays, unless the markup says it is JSON.
        ('{"x": 1}', "unknown", None, '{"x": 1}'),
        ("42", "unknown", None, "42"),
        ("42", "unknown", {"description": "any"}, "42"),
        ("hello", "unknown", None, "hello"),
        ("42", "text", None, "42"),
        ("42", "json", None, 42),
        ("hello", "json", None, "hello"),
        # Python-style and other spellings of the type names.
        ("123", "unknown", {"type": "str"}, "123"),
        ("007", "unknown", {"type": "int"}, 7),
        (".5", "unknown", {"type": "float"}, 0.5),
        ("1", "unknown", {"type": "bool"}, True),
        ("{'a': 1}", "unknown", {"type": "dict"}, {"a": 1}),
        ("[1, 'x']", "unknown", {"type": "list"}, [1, "x"]),
        ("true", "unknown", {"type": " String "}, "true"),
        ("null", "unknown", {"type": ["Int64", "null"]}, None),
        ('{"x": 1}', "json", {"anyOf": [{"type": "object"}, {"type": "null"}]}, {"x": 1}),
        ("b", "unknown", {"enum": ["a", "b"]}, "b"),
        ("2", "unknown", {"enum": [1, 2]}, 2),
    ],
)
def test_value_typed_by_schema(
    text: str, encoding: ValueEncoding, schema: dict[str, Any] | None, expected: Any
) -> None:
    value = type_value(text, encoding, schema)

    assert value == expected
    assert type(value) is type(expected)


def test_declared_types_read_unions_and_structural_hints() -> None:
    assert declared_types({"type": ["string", "null"]}) == {"string", "null"}
    assert declared_types({"oneOf": [{"type": "integer"}, {"type": "string"}]}) == {
        "integer",
        "string",
    }
    assert declared_types({"properties": {}}) == {"object"}
    assert declared_types({"items": {}}) == {"array"}
    assert declared_types({"description": "anything"}) == frozenset()
    assert declared_types({"type": ["str", "null"]}) == {"string", "null"}
    assert declared_types({"anyOf": [{"type": "Double"}, {"type": "sequence"}]}) == {
        "number",
        "array",
    }


def test_tool_schemas_accept_openai_tools_and_bare_functions_and_skip_junk() -> None:
    schemas = ToolSchemas(
        [
            {
                "type": "function",
                "function": {"name": "a", "parameters": {"properties": {"n": INTEGER}}},
            },
            {"name": "b", "parameters": {"properties": {"s": STRING}}},
            {"type": "function", "function": {"description": "no name"}},
            "not a tool",  # type: ignore[list-item]
        ]
    )

    assert schemas.parameter_schema("a", "n") == INTEGER
    assert schemas.parameter_schema("b", "s") == STRING
    assert schemas.parameter_schema("a", "missing") is None
    assert schemas.parameter_schema("unknown_tool", "n") is None


_SCHEMAS = [
    None,
    STRING,
    INTEGER,
    NUMBER,
    BOOLEAN,
    OBJECT,
    ARRAY,
    NULLABLE_INTEGER,
    {"enum": [1, "a"]},
]


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=30),
        st.from_regex(r"[-+]?[0-9.eE_]{1,12}", fullmatch=True),
        st.sampled_from(["NaN", "-Infinity", "1e999", "{'a': 1e999}", "[1, {2}]", "9" * 4400]),
    ),
    encoding=st.sampled_from(["text", "json", "unknown"]),
    schema=st.sampled_from(_SCHEMAS),
)
def test_any_text_types_to_strict_json_without_raising(
    text: str, encoding: ValueEncoding, schema: dict[str, Any] | None
) -> None:
    value = type_value(text, encoding, schema)

    assert json.loads(json.dumps(value, allow_nan=False)) == value


def test_a_long_digit_run_that_is_not_a_number_types_in_linear_time() -> None:
    text = "1" * 30_000 + "x"
    started = time.perf_counter()
    value = type_value(text, "unknown", NUMBER)
    elapsed_s = time.perf_counter() - started

    assert value == text
    assert elapsed_s < 5.0  # the ambiguous pattern took minutes


def test_lone_surrogates_go_out_escaped_and_everything_else_verbatim() -> None:
    """A `\\ud83d` escape without its pair decodes to a lone surrogate, which UTF-8 cannot carry:
    the gateway's response failed to encode (a 500, or a stream cut off)."""
    value = type_value('"\\ud83d and \\ud83d\\ude00 caf\\u00e9"', "json", STRING)
    assert value == "\ud83d and \U0001f600 caf\u00e9"

    text = arguments_json({"s": value, "\udc00key": ["\udfff"]})

    text.encode("utf-8")  # what sending the response does
    assert json.loads(text) == {"s": value, "\udc00key": ["\udfff"]}
    assert "\U0001f600 caf\u00e9" in text


SEARCH_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"properties": {"query": STRING, "limit": INTEGER}},
        },
    }
]


@pytest.mark.parametrize(
    ("wrapper", "text", "encoding"),
    [
        ("arguments", '{"query": "cats", "limit": "3"}', "text"),
        ("input", '{"query": "cats", "limit": 3}', "json"),
        ("arguments", '"{\\"query\\": \\"cats\\", \\"limit\\": 3}"', "json"),
    ],
)
def test_arguments_wrapped_in_one_undeclared_parameter_are_unwrapped(
    wrapper: str, text: str, encoding: ValueEncoding
) -> None:
    # vLLM unwraps these for DeepSeek-V4 (`_unwrap_wrapper_args`).
    schemas = ToolSchemas(SEARCH_TOOL)
    typed = schemas.type_arguments("search", [RawArgument(wrapper, text, encoding)])

    assert typed == {"query": "cats", "limit": 3}


@pytest.mark.parametrize(
    "arguments",
    [
        [RawArgument("arguments", '{"query": "cats", "other": 1}')],  # a key the tool lacks
        [RawArgument("arguments", '{"query": "cats"}'), RawArgument("limit", "3")],
        [RawArgument("arguments", "[1, 2]")],
        [RawArgument("payload", '{"query": "cats"}')],
    ],
)
def test_anything_else_named_like_a_wrapper_is_left_alone(arguments: list[RawArgument]) -> None:
    schemas = ToolSchemas(SEARCH_TOOL)
    typed = schemas.type_arguments("search", arguments)

    assert list(typed) == [argument.name for argument in arguments]
