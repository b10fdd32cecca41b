"""Feeding output through `ChatOutputParser` in several ways and checking the stream's shape."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from services.gateway.parsing import AssistantMessage, ChatOutputParser, MessageDelta


def sequential_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def split_at(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    return [text[start:end] for start, end in itertools.pairwise(points)]


def chunks_of(text: str, size: int) -> list[str]:
    return [text[start : start + size] for start in range(0, len(text), size)]


def stream(
    pieces: Sequence[str], *, model_stopped: bool = False, **parser_options: Any
) -> tuple[list[MessageDelta], AssistantMessage]:
    """Deltas from feeding `pieces`, and the message an OpenAI client accumulates from them.

    `model_stopped`: the output ended with finish_reason "stop" rather than "length"."""
    parser = ChatOutputParser(make_call_id=sequential_ids(), **parser_options)
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish(model_stopped=model_stopped))
    accumulated = AssistantMessage.from_deltas(deltas)
    assert parser.message() == accumulated
    assert parser.has_tool_calls == accumulated.has_tool_calls
    return deltas, accumulated


def assert_openai_delta_shape(deltas: Sequence[MessageDelta]) -> None:
    """Per call: index in order, id + type + name first, then arguments forming a JSON object."""
    arguments_by_index: dict[int, str] = {}
    for delta in deltas:
        for entry in delta.tool_calls:
            if entry.index not in arguments_by_index:
                assert entry.index == len(arguments_by_index)
                assert entry.id and entry.type == "function" and entry.name
                arguments_by_index[entry.index] = entry.arguments or ""
            else:
                assert entry.id is None and entry.type is None and entry.name is None
                arguments_by_index[entry.index] += entry.arguments or ""
    for arguments in arguments_by_index.values():
        assert isinstance(json.loads(arguments), dict)


def parse_every_way(
    text: str, *, model_stopped: bool = False, **parser_options: Any
) -> AssistantMessage:
    """The message, after checking that whole, 1-, 2-, 3- and 7-character feeding agree."""
    _, whole = stream([text], model_stopped=model_stopped, **parser_options)
    for size in (1, 2, 3, 7):
        deltas, streamed = stream(
            chunks_of(text, size), model_stopped=model_stopped, **parser_options
        )
        assert streamed == whole, f"chunk size {size}"
        assert_openai_delta_shape(deltas)
    return whole


def arguments_of(message: AssistantMessage) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, json.loads(call.arguments)) for call in message.tool_calls]
