"""Tool calls a request forces (`tool_choice: "required"` or one named function).

As in vLLM, forced calls do not go through the model family's tool-call markup: the engine
holds the output to a JSON schema, so any model can answer them. A named function's output
is its arguments object, streamed as argument deltas; "required" gives a JSON array of
`{"name", "parameters"}` objects, released as calls when the choice ends (a partial array
says nothing certain about a call; one cut short by the token limit gives its whole entries).
In that array schema each tool's definitions (`$defs`, or draft-07's `definitions`) move to
the root, where its `#/$defs/...` references resolve, as vLLM moves them.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.gateway.parsing.argument_typing import arguments_json
from services.gateway.parsing.messages import AssistantMessage, MessageDelta, ToolCall, ToolCallDelta
from services.gateway.parsing.output_parser import ChatOutputParser, new_call_id

# A function declared without parameters takes an object (OpenAI's reading).
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Where JSON schemas keep reusable definitions: `$defs` (pydantic), `definitions` (draft-07, as
# zod-to-json-schema writes them).
_DEFINITION_KEYWORDS = ("$defs", "definitions")
# What JSON allows between its tokens; it matches at any position, if only the empty string.
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True, slots=True)
class ForcedToolChoice:
    """The functions a forced choice picks from; `named` when the request named one."""

    functions: tuple[Mapping[str, Any], ...]
    named: bool
    allow_parallel: bool = True

    @classmethod
    def of(cls, tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None,
           parallel_tool_calls: bool | None) -> ForcedToolChoice | None:
        """None unless `tool_choice` forces a call; the request's tools are already validated."""
        functions = tuple(tool["function"] for tool in tools or ())
        if tool_choice == "required":
            return cls(functions, named=False, allow_parallel=parallel_tool_calls is not False)
        if isinstance(tool_choice, Mapping):
            name = tool_choice["function"]["name"]
            return cls(tuple(f for f in functions if f["name"] == name), named=True)
        return None

    def json_schema(self) -> dict[str, Any]:
        if self.named:
            return dict(self.functions[0].get("parameters") or ANY_OBJECT)
        definitions: dict[str, dict[str, Any]] = {}
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                 "parameters": _hoist_definitions(f.get("parameters") or ANY_OBJECT,
                                                                  definitions)},
                  "required": ["name", "parameters"]} for f in self.functions]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                                  **definitions}
        if not self.allow_parallel:
            schema["maxItems"] = 1
        return schema

    def parser(self, reasoning_parser: str | None = None,
               make_call_id: Callable[[], str] = new_call_id) -> ForcedToolCallParser:
        """`reasoning_parser`: the output starts inside the model's reasoning, in that family's
        markup."""
        return ForcedToolCallParser(self.functions[0]["name"] if self.named else None, make_call_id,
                                    reasoning_parser)


def _hoist_definitions(parameters: Mapping[str, Any],
                       hoisted: dict[str, dict[str, Any]]) -> Mapping[str, Any]:
    """`parameters` less its definitions, which join `hoisted` (keyword -> name -> schema).

    A `#/$defs/Item` reference resolves against the root of the whole schema, the array of calls.
    Where another tool already put a different schema under one of this tool's names, all of
    this tool's definitions get new names, and its references follow them.
    """
    own = {keyword: parameters[keyword] for keyword in _DEFINITION_KEYWORDS
           if isinstance(parameters.get(keyword), Mapping)}
    if not own:
        return parameters
    rest = {key: value for key, value in parameters.items() if key not in own}
    clashes = any(hoisted.get(keyword, {}).get(name, definition) != definition
                  for keyword, definitions in own.items()
                  for name, definition in definitions.items())
    if not clashes:
        for keyword, definitions in own.items():
            hoisted.setdefault(keyword, {}).update(definitions)
        return rest
    renames: dict[str, str] = {}
    renamed: list[tuple[str, str]] = []
    for keyword, definitions in own.items():
        taken = hoisted.setdefault(keyword, {})
        for name, definition in definitions.items():
            new_name = next(candidate for number in itertools.count(2)
                            if (candidate := f"{name}_{number}") not in taken)
            taken[new_name] = definition  # holds the name; its references are renamed below
            renamed.append((keyword, new_name))
            old_reference = f"#/{keyword}/{_pointer_token(name)}"
            renames[old_reference] = f"#/{keyword}/{_pointer_token(new_name)}"
    for keyword, new_name in renamed:
        hoisted[keyword][new_name] = _with_references_renamed(hoisted[keyword][new_name], renames)
    return _with_references_renamed(rest, renames)


def _pointer_token(name: str) -> str:
    """`name` as one step of a JSON pointer (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def _with_references_renamed(schema: Any, renames: Mapping[str, str]) -> Any:
    """A copy of `schema` whose `$ref`s into a renamed definition point at its new name."""
    if isinstance(schema, list):
        return [_with_references_renamed(item, renames) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    copy = {key: _with_references_renamed(value, renames) for key, value in schema.items()}
    reference = copy.get("$ref")
    if isinstance(reference, str):
        for old, new in renames.items():
            if reference == old or reference.startswith(old + "/"):
                copy["$ref"] = new + reference[len(old):]
                break
    return copy


class ForcedToolCallParser:
    """Reads one choice's constrained output as tool calls (the `ChatOutputParser` interface).

    With `reasoning_parser`, the output starts inside the model's reasoning, which the engine
    leaves unconstrained: the reasoning is read off the front in that family's markup, and the
    calls from the text after it.
    """

    def __init__(self, function_name: str | None, make_call_id: Callable[[], str],
                 reasoning_parser: str | None = None) -> None:
        self._function_name = function_name
        self._make_call_id = make_call_id
        self._reasoning = (ChatOutputParser(reasoning_parser=reasoning_parser, thinking=True)
                           if reasoning_parser else None)
        self._call_id: str | None = None
        self._parts: list[str] = []
        self._message = AssistantMessage()

    @property
    def has_tool_calls(self) -> bool:
        return self._call_id is not None or bool(self._message.tool_calls)

    def feed(self, text_delta: str) -> MessageDelta:
        if self._reasoning is None:
            return self._feed_calls(text_delta)
        return self._after_reasoning(self._reasoning.feed(text_delta))

    def finish(self, *, model_stopped: bool = False) -> MessageDelta:
        """`model_stopped` changes nothing here: whether the constrained JSON is whole says
        itself whether the calls are."""
        delta = MessageDelta() if self._reasoning is None else self._after_reasoning(
            self._reasoning.finish())
        ending = self._finish_calls()
        delta.content = ending.content
        delta.tool_calls += ending.tool_calls
        return delta

    def message(self) -> AssistantMessage:
        if self._reasoning is None:
            return self._message
        return replace(self._message, reasoning_content=self._reasoning.message().reasoning_content)

    def _after_reasoning(self, split: MessageDelta) -> MessageDelta:
        """The reasoning as it is, and what followed it read as calls."""
        delta = self._feed_calls(split.content or "")
        delta.reasoning_content = split.reasoning_content
        return delta

    def _feed_calls(self, text_delta: str) -> MessageDelta:
        self._parts.append(text_delta)
        if self._function_name is None or not text_delta:
            return MessageDelta()
        if self._call_id is None:
            self._call_id = self._make_call_id()
            return MessageDelta(tool_calls=[ToolCallDelta(0, self._call_id, "function",
                                                          self._function_name, text_delta)])
        return MessageDelta(tool_calls=[ToolCallDelta(0, arguments=text_delta)])

    def _finish_calls(self) -> MessageDelta:
        text = "".join(self._parts)
        if self._function_name is not None:
            if self._call_id is not None:
                self._message = AssistantMessage(
                    tool_calls=[ToolCall(self._call_id, self._function_name, text)])
            return MessageDelta()
        # Cut short (finish_reason "length"): the array's whole entries are calls; the cut one,
        # half a call, is dropped, and the array's JSON is no answer to show as text.
        calls = _calls_in(text)
        self._message = AssistantMessage(tool_calls=[
            ToolCall(self._make_call_id(), name, arguments_json(arguments))
            for name, arguments in calls])
        return MessageDelta(tool_calls=[
            ToolCallDelta(index, call.id, "function", call.name, call.arguments)
            for index, call in enumerate(self._message.tool_calls)])


def _calls_in(text: str) -> list[tuple[str, Any]]:
    """The (name, arguments) pairs of a "required" choice's JSON array, up to its first entry
    that is cut short or not a call."""
    decoder = json.JSONDecoder()
    position = _after_space(text, 0)
    if not text.startswith("[", position):
        return []
    calls: list[tuple[str, Any]] = []
    position += 1
    while True:
        position = _after_space(text, position)
        try:
            # RecursionError: deep nesting (a loop cut short).
            entry, position = decoder.raw_decode(text, position)
        except (ValueError, RecursionError):
            return calls
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and "parameters" in entry):
            return calls
        calls.append((entry["name"], entry["parameters"]))
        position = _after_space(text, position)
        if not text.startswith(",", position):
            return calls
        position += 1


def _after_space(text: str, position: int) -> int:
    return _JSON_SPACE.match(text, position).end()  # type: ignore[union-attr]
