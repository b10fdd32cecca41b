"""The assistant message and its streaming deltas, in OpenAI's chat-completion shape.

A stream is a sequence of `MessageDelta`s; `AssistantMessage.from_deltas` accumulates them the
way an OpenAI client does (strings concatenate, tool-call entries merge by `index`), so the
streamed and the non-streamed message can be compared directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal


def reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """The reasoning under both of its names: vLLM's `reasoning` and the `reasoning_content`
    of DeepSeek's API (and of vLLM before 0.11), which clients still read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One entry of `delta.tool_calls`: the first for a call carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    name: str | None = None
    arguments: str | None = None

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            entry["id"] = self.id
        if self.type is not None:
            entry["type"] = self.type
        function: dict[str, str] = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        if function:
            entry["function"] = function
        return entry


@dataclass(slots=True)
class MessageDelta:
    """What one `feed` (or `finish`) adds to the message; None means nothing new."""

    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.reasoning_content is None and self.content is None and not self.tool_calls

    def to_dict(self) -> dict[str, Any]:
        """The `choices[i].delta` object of a chat.completion.chunk (empty fields left out)."""
        delta: dict[str, Any] = {}
        if self.reasoning_content is not None:
            delta |= reasoning_fields(self.reasoning_content)
        if self.content is not None:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return delta


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A complete tool call; `arguments` is a JSON object serialised as a string."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class AssistantMessage:
    """The final (non-streamed) assistant message; empty text fields are None."""

    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.tool_calls)

    def to_dict(self) -> dict[str, Any]:
        """`choices[i].message` of a chat.completion; `tool_calls` only when there are some."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content,
                                   **reasoning_fields(self.reasoning_content)}
        if self.tool_calls:
            message["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return message

    @classmethod
    def from_deltas(cls, deltas: Iterable[MessageDelta]) -> AssistantMessage:
        """Accumulate a stream of deltas as an OpenAI client would."""
        reasoning_parts: list[str] = []
        content_parts: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        for delta in deltas:
            if delta.reasoning_content is not None:
                reasoning_parts.append(delta.reasoning_content)
            if delta.content is not None:
                content_parts.append(delta.content)
            for entry in delta.tool_calls:
                call = calls.setdefault(entry.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += entry.id or ""
                call["name"] += entry.name or ""
                call["arguments"] += entry.arguments or ""
        return cls(
            reasoning_content="".join(reasoning_parts) or None,
            content="".join(content_parts) or None,
            tool_calls=[ToolCall(**calls[index]) for index in sorted(calls)],
        )
