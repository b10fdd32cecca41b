"""Tool calls a request forces (`tool_choice: "required"` or one named function).

As in vLLM, forced calls do not go through the model family's tool-call markup: the engine
holds the output to a JSON schema, so any model can answer them. A named function's output
is its arguments object, streamed as argument deltas; "required" gives a JSON array of
`{"name", "parameters"}` objects, released as calls when the choice ends (a partial array
says nothing certain about a call).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.parsing.argument_typing import arguments_json
from services.gateway.parsing.messages import AssistantMessage, MessageDelta, ToolCall, ToolCallDelta
from services.gateway.parsing.output_parser import new_call_id

# A function declared without parameters takes an object (OpenAI's reading).
ANY_OBJECT: dict[str, Any] = {"type": "object"}


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
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                 "parameters": f.get("parameters") or ANY_OBJECT},
                  "required": ["name", "parameters"]} for f in self.functions]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.allow_parallel:
            schema["maxItems"] = 1
        return schema

    def parser(self, make_call_id: Callable[[], str] = new_call_id) -> ForcedToolCallParser:
        return ForcedToolCallParser(self.functions[0]["name"] if self.named else None, make_call_id)


class ForcedToolCallParser:
    """Reads one choice's constrained output as tool calls (the `ChatOutputParser` interface)."""

    def __init__(self, function_name: str | None, make_call_id: Callable[[], str]) -> None:
        self._function_name = function_name
        self._make_call_id = make_call_id
        self._call_id: str | None = None
        self._parts: list[str] = []
        self._message = AssistantMessage()

    @property
    def has_tool_calls(self) -> bool:
        return self._call_id is not None or bool(self._message.tool_calls)

    def feed(self, text_delta: str) -> MessageDelta:
        self._parts.append(text_delta)
        if self._function_name is None or not text_delta:
            return MessageDelta()
        if self._call_id is None:
            self._call_id = self._make_call_id()
            return MessageDelta(tool_calls=[ToolCallDelta(0, self._call_id, "function",
                                                          self._function_name, text_delta)])
        return MessageDelta(tool_calls=[ToolCallDelta(0, arguments=text_delta)])

    def finish(self) -> MessageDelta:
        text = "".join(self._parts)
        if self._function_name is not None:
            if self._call_id is not None:
                self._message = AssistantMessage(
                    tool_calls=[ToolCall(self._call_id, self._function_name, text)])
            return MessageDelta()
        calls = _calls_in(text)
        if calls is None:
            # Cut short (finish_reason "length"): what came is returned as text.
            self._message = AssistantMessage(content=text or None)
            return MessageDelta(content=text or None)
        self._message = AssistantMessage(tool_calls=[
            ToolCall(self._make_call_id(), name, arguments_json(arguments))
            for name, arguments in calls])
        return MessageDelta(tool_calls=[
            ToolCallDelta(index, call.id, "function", call.name, call.arguments)
            for index, call in enumerate(self._message.tool_calls)])

    def message(self) -> AssistantMessage:
        return self._message


def _calls_in(text: str) -> list[tuple[str, Any]] | None:
    """The (name, arguments) pairs of a "required" choice's JSON array; None if it is not one."""
    try:
        entries = json.loads(text)
    except (ValueError, RecursionError):  # deep nesting (a loop cut short) raises the latter
        return None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and "parameters" in e
            for e in entries):
        return None
    return [(e["name"], e["parameters"]) for e in entries]
