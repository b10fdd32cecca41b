"""Typing tool-call argument values by the request's tool JSON schemas.

The markup formats carry every value as text. The schema decides what it becomes: a `string`
parameter keeps its text verbatim ("007" stays "007"), an `integer` parameter "3" becomes 3,
`number`, `boolean`, `null`, `object` and `array` are read as JSON (Python-literal spellings such
as `True` or `{'a': 1}` are accepted too, since models produce them, and `1`/`0` for a boolean, as
vLLM reads them). Type names some clients write the Python or SQL way (`str`, `int`, `float`,
`bool`, `dict`, `list`, `varchar`, `int64`, `double`...) or capitalised mean the JSON type, as
vLLM maps them. A parameter the schema does not type (one it does not declare, or declares
without a type) keeps its text, as vLLM keeps it: only a value the markup marks as JSON (DSML's
`string="false"`) is read as JSON then; a guess would turn a string such as "123" or "true" into
another type for good. Members of an object or array are typed the same way by the schema's
`properties` or `items` (through `anyOf`/`oneOf`/`allOf`), as vLLM's deepseek_v4 parser types
them: models write `{"quantity": "2"}` for an integer member too. Members the schema does not
describe are left as written.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

ValueEncoding = Literal["text", "json", "unknown"]
"""How the markup says a value is written: as plain text, as JSON, or not said (the schema
decides; without a type there, the value is the text)."""

_NON_STRING_TYPES = ("integer", "number", "boolean", "null", "object", "array")
# Other spellings of the JSON types, by the JSON type they mean (the names vLLM maps).
_TYPE_SPELLINGS: dict[str, tuple[str, ...]] = {
    "string": ("str", "text", "varchar", "char", "enum"),
    "integer": ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
    "number": ("float", "float32", "float64", "double"),
    "boolean": ("bool",),
    "object": ("dict",),
    "array": ("list", "arr", "sequence"),
}
_JSON_TYPE_OF_SPELLING = {
    spelling: json_type
    for json_type, spellings in _TYPE_SPELLINGS.items()
    for spelling in spellings
}
_FAILED = object()
# Parameters a model sometimes wraps the whole arguments object in (see `_unwrapped`).
_WRAPPER_NAMES = ("arguments", "input")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class RawArgument:
    """One parameter as the model wrote it, before typing."""

    name: str
    text: str
    encoding: ValueEncoding = "unknown"


class ToolSchemas:
    """Parameter schemas of the request's tools, looked up by tool and parameter name."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        self._properties: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function", tool) if isinstance(tool, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                continue
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
            self._properties[function["name"]] = (
                properties if isinstance(properties, Mapping) else {}
            )

    def parameter_schema(self, tool_name: str, parameter: str) -> Mapping[str, Any] | None:
        schema = self._properties.get(tool_name, {}).get(parameter)
        return schema if isinstance(schema, Mapping) else None

    def declares(self, tool_name: str) -> bool:
        """Whether the request's tools include `tool_name`; True when the request gave none."""
        return not self._properties or tool_name in self._properties

    def type_arguments(self, tool_name: str, arguments: Sequence[RawArgument]) -> dict[str, Any]:
        return {
            argument.name: type_value(
                argument.text, argument.encoding, self.parameter_schema(tool_name, argument.name)
            )
            for argument in self._unwrapped(tool_name, arguments)
        }

    def _unwrapped(
        self, tool_name: str, arguments: Sequence[RawArgument]
    ) -> Sequence[RawArgument]:
        """The arguments inside an `arguments` or `input` parameter that the tool does not have.

        Models sometimes put the whole arguments object in one such parameter (vLLM unwraps it
        for DeepSeek-V4 too); it is taken out only when every key inside is the tool's own.
        """
        properties = self._properties.get(tool_name)
        if not properties or len(arguments) != 1:
            return arguments
        wrapper = arguments[0]
        if wrapper.name not in _WRAPPER_NAMES or wrapper.name in properties:
            return arguments
        inner = _loads_json(wrapper.text)
        if isinstance(inner, str):  # the object written as a JSON string
            inner = _loads_json(inner)
        if not isinstance(inner, dict) or not inner.keys() <= properties.keys():
            return arguments
        return tuple(
            RawArgument(name, json.dumps(value, ensure_ascii=False), "json")
            for name, value in inner.items()
        )


def arguments_json(arguments: Any) -> str:
    """A tool call's typed arguments as the JSON text sent to the client.

    Non-ASCII characters stay as they are, except lone surrogates: a `\\ud83d` escape the model
    wrote without its pair decodes to one, and UTF-8 cannot carry it, so the whole response
    would fail to encode. It goes out escaped again, which is the same JSON value.
    """
    text = json.dumps(arguments, ensure_ascii=False)
    return _LONE_SURROGATE.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def declared_types(schema: Mapping[str, Any] | None) -> frozenset[str]:
    """The JSON types a schema admits; empty when it does not say."""
    if not schema:
        return frozenset()
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({_json_type_named(declared)})
    if isinstance(declared, list):
        return frozenset(_json_type_named(name) for name in declared if isinstance(name, str))
    for combinator in ("anyOf", "oneOf", "allOf"):
        options = schema.get(combinator)
        if isinstance(options, list):
            return frozenset().union(
                *(declared_types(option) for option in options if isinstance(option, Mapping))
            )
    if isinstance(schema.get("enum"), list):
        return frozenset(_json_type(value) for value in schema["enum"])
    if "const" in schema:
        return frozenset({_json_type(schema["const"])})
    if "properties" in schema:
        return frozenset({"object"})
    if "items" in schema:
        return frozenset({"array"})
    return frozenset()


def _json_type_named(name: str) -> str:
    """The JSON type a schema's type name means (`int` and `Integer` mean `integer`)."""
    normalized = name.strip().lower()
    return _JSON_TYPE_OF_SPELLING.get(normalized, normalized)


def type_value(text: str, encoding: ValueEncoding, schema: Mapping[str, Any] | None) -> Any:
    """The typed value of one argument (see the module docstring for the rules)."""
    return _typed_members(_typed_text(text, encoding, schema), schema)


def _typed_text(text: str, encoding: ValueEncoding, schema: Mapping[str, Any] | None) -> Any:
    types = declared_types(schema)
    if encoding == "json":
        parsed = _loads_json(text)
        if parsed is not _FAILED:
            if not types or _json_type(parsed) in types or _is_whole(parsed, types):
                return parsed
            if isinstance(parsed, str):
                text = parsed  # a quoted "3" for an integer: type what is inside the quotes
    if not types:
        return text
    for type_name in _NON_STRING_TYPES:
        if type_name in types:
            value = _CONVERTERS[type_name](text.strip())
            if value is not _FAILED:
                return value
    if "string" in types:
        return text
    parsed = _loads_json(text)
    return text if parsed is _FAILED else parsed


def _typed_members(value: Any, schema: Mapping[str, Any] | None) -> Any:
    """`value` with the members of its objects and arrays typed by the schema's nested schemas.

    Only where the schema describes them: the recursion follows the schema, which is finite.
    """
    if isinstance(value, dict):
        properties = _nested_schema(schema, "properties")
        if properties is None:
            return value
        return {key: _typed_member(member, properties.get(key)) for key, member in value.items()}
    if isinstance(value, list):
        items = _nested_schema(schema, "items")
        if items is None:
            return value
        return [_typed_member(member, items) for member in value]
    return value


def _typed_member(value: Any, schema: Any) -> Any:
    if not isinstance(schema, Mapping):
        return value
    types = declared_types(schema)
    if types and _json_type(value) not in types and not _is_whole(value, types):
        # Typed as if the model had written the member as a JSON-encoded argument.
        value = _typed_text(json.dumps(value, ensure_ascii=False), "json", schema)
    return _typed_members(value, schema)


def _nested_schema(schema: Mapping[str, Any] | None, key: str) -> Mapping[str, Any] | None:
    """`schema[key]` (`properties` or `items`), or the first one an `anyOf`/`oneOf`/`allOf`
    option holds (an optional object is `anyOf: [{object}, {null}]`)."""
    if not isinstance(schema, Mapping):
        return None
    nested = schema.get(key)
    if isinstance(nested, Mapping):
        return nested
    for combinator in ("anyOf", "oneOf", "allOf"):
        options = schema.get(combinator)
        for option in options if isinstance(options, list) else ():
            nested = _nested_schema(option, key)
            if nested is not None:
                return nested
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _is_whole(value: Any, types: frozenset[str]) -> bool:
    """An integer also satisfies `number`."""
    return "number" in types and _json_type(value) == "integer"


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; a client's strict parser would reject the arguments.
    raise ValueError(f"non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range {text}")
    return value


def _loads_json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return _FAILED


# Spellings JSON rejects but a model writing a number means as one: "007", "+3", ".5", "1.".
# Each digit run can be matched one way only: with `\d+\.?\d*` a long run of digits that
# fails to match at its end is retried at every split point (quadratic time).
_LOOSE_INTEGER = re.compile(r"[-+]?\d+")
_LOOSE_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _to_integer(text: str) -> Any:
    if _LOOSE_INTEGER.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # past Python's limit on digits converted from text
            return _FAILED
    value = _loads_json(text)
    if isinstance(value, bool):
        return _FAILED
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return _FAILED


def _to_number(text: str) -> Any:
    value = _loads_json(text)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if _LOOSE_NUMBER.fullmatch(text):
        number = float(text)
        return number if math.isfinite(number) else _FAILED
    return _FAILED


def _to_boolean(text: str) -> Any:
    return {"true": True, "false": False, "1": True, "0": False}.get(text.lower(), _FAILED)


def _to_null(text: str) -> Any:
    return None if text.lower() in ("null", "none") else _FAILED


def _to_container(kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        value = _loads_json(text)
        if value is _FAILED:
            # Models sometimes write Python literals (single quotes, True/None).
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
                return _FAILED
        if not isinstance(value, kind):
            return _FAILED
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            return _FAILED
        return value

    return convert


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "integer": _to_integer,
    "number": _to_number,
    "boolean": _to_boolean,
    "null": _to_null,
    "object": _to_container(dict),
    "array": _to_container(list),
}
