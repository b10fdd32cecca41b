"""Validates OpenAI chat messages and tool schemas into typed values every renderer shares.

Normalization follows what vLLM's OpenAI server does before any template sees a request, so
prompts match a vLLM deployment byte for byte: `reasoning` wins over the older
`reasoning_content`, tool-call arguments become JSON objects (a malformed arguments string in
the history becomes `{}` rather than failing every later turn), and tool schemas keep only
OpenAI's function fields in OpenAI's order. As in vLLM, any role reaches the renderer (OpenAI's
legacy `function` role, a role only the model's template knows) and a message without content
has no text; a renderer refuses what its format cannot write.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.tokenizer.chat_formats.protocol import ChatRenderError

# Content part types vLLM's chat server reads as text, each with the key its text is under:
# assistant turns replayed from OpenAI's API carry `refusal` parts.
_TEXT_PART_KEYS: dict[str, str] = {"text": "text", "refusal": "refusal", "thinking": "thinking"}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call from an assistant turn; `arguments` is always a JSON object."""

    call_id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One validated message. `text_parts` keeps content parts apart: formats join them differently."""

    role: str
    text_parts: tuple[str, ...]
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


def parse_messages(messages: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    """Validates the request's `messages`; raises `ChatRenderError` naming the bad field."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatRenderError("messages", "must be a list of message objects")
    if not messages:
        raise ChatRenderError("messages", "must contain at least one message")
    return [_parse_message(f"messages[{index}]", message) for index, message in enumerate(messages)]


def parse_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Validates `tools` and returns them in vLLM's serialized shape (`[]` when there are none)."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ChatRenderError("tools", "must be a list of tool objects")
    return [_parse_tool(f"tools[{index}]", tool) for index, tool in enumerate(tools)]


def _parse_message(path: str, message: Any) -> ChatMessage:
    if not isinstance(message, Mapping):
        raise ChatRenderError(path, "must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatRenderError(f"{path}.role", "is required and must be a string")
    content = message.get("content")
    tool_calls = _parse_tool_calls(f"{path}.tool_calls", message.get("tool_calls")) if role == "assistant" else ()
    reasoning = _optional_str(path, message, "reasoning")
    if reasoning is None:
        reasoning = _optional_str(path, message, "reasoning_content")
    return ChatMessage(
        role=role,
        text_parts=_parse_content(f"{path}.content", content),
        reasoning=reasoning if role == "assistant" else None,
        tool_calls=tool_calls,
        tool_call_id=_optional_str(path, message, "tool_call_id") if role == "tool" else None,
        name=_optional_str(path, message, "name"),
    )


def _parse_content(path: str, content: Any) -> tuple[str, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (content,)
    if not isinstance(content, list):
        raise ChatRenderError(path, "must be a string or a list of text parts")
    parts: list[str] = []
    for index, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatRenderError(f"{path}[{index}]", "must be an object")
        part_type = part.get("type")
        key = _TEXT_PART_KEYS.get(part_type) if isinstance(part_type, str) else None
        if key is None:
            raise ChatRenderError(f"{path}[{index}].type",
                                  f"unsupported content part type {part_type!r}; "
                                  f"only text parts ({', '.join(_TEXT_PART_KEYS)}) are accepted")
        text = part.get(key)
        if not isinstance(text, str):
            raise ChatRenderError(f"{path}[{index}].{key}", "must be a string")
        parts.append(text)
    return tuple(parts)


def _parse_tool_calls(path: str, tool_calls: Any) -> tuple[ToolCall, ...]:
    if tool_calls is None:
        return ()
    if not isinstance(tool_calls, list):
        raise ChatRenderError(path, "must be a list")
    parsed: list[ToolCall] = []
    for index, call in enumerate(tool_calls):
        call_path = f"{path}[{index}]"
        if not isinstance(call, Mapping):
            raise ChatRenderError(call_path, "must be an object")
        if call.get("type", "function") != "function":
            raise ChatRenderError(f"{call_path}.type", "only 'function' tool calls are supported")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ChatRenderError(f"{call_path}.function", "must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatRenderError(f"{call_path}.function.name", "must be a non-empty string")
        call_id = call.get("id")
        # OpenAI's schema requires the id and vLLM's server refuses a call without one, so no
        # template sees a call the client never named (nor an invented empty id).
        if not isinstance(call_id, str):
            raise ChatRenderError(f"{call_path}.id", "is required and must be a string")
        parsed.append(ToolCall(call_id=call_id, name=name,
                               arguments=_arguments_object(function.get("arguments"))))
    return tuple(parsed)


def _arguments_object(arguments: Any) -> dict[str, Any]:
    # History is replayed on every later turn: one bad arguments string must not make the
    # whole conversation unrenderable, so anything that is not a JSON object becomes {}.
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str) and arguments:
        try:
            decoded = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            return {}
        return decoded if isinstance(decoded, dict) else {}
    return {}


def _parse_tool(path: str, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, Mapping):
        raise ChatRenderError(path, "must be an object")
    if tool.get("type", "function") != "function":
        raise ChatRenderError(f"{path}.type", "only 'function' tools are supported")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ChatRenderError(f"{path}.function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ChatRenderError(f"{path}.function.name", "must be a non-empty string")
    description = _optional_str(f"{path}.function", function, "description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ChatRenderError(f"{path}.function.parameters", "must be a JSON Schema object")
    # Field order and the kept nulls are what templates serialize, so they are part of the prompt.
    normalized: dict[str, Any] = {"name": name, "description": description,
                                  "parameters": dict(parameters) if parameters is not None else None}
    strict = function.get("strict")
    if strict is not None:
        normalized["strict"] = strict
    defer_loading = function.get("defer_loading", tool.get("defer_loading"))
    if defer_loading is not None:
        normalized["defer_loading"] = defer_loading
    serialized: dict[str, Any] = {"type": "function", "function": normalized}
    if tool.get("defer_loading") is not None:
        serialized["defer_loading"] = tool["defer_loading"]
    return serialized


def _optional_str(path: str, mapping: Mapping[str, Any], key: str) -> str | None:
    value = mapping.get(key)
    if value is not None and not isinstance(value, str):
        raise ChatRenderError(f"{path}.{key}", "must be a string")
    return value
