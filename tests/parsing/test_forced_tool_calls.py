"""Forced tool choices: the schema the engine is held to, and reading its output back."""

from __future__ import annotations

import json
from itertools import count

import pytest

from services.gateway.parsing import AssistantMessage, MessageDelta
from services.gateway.parsing.forced_tool_calls import ForcedToolChoice

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time"}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]


def _ids() -> object:
    numbers = count()
    return lambda: f"call_{next(numbers)}"


def _run(choice: ForcedToolChoice, pieces: list[str], reasoning_parser: str | None = None
         ) -> tuple[list[MessageDelta], AssistantMessage]:
    parser = choice.parser(reasoning_parser, make_call_id=_ids())  # type: ignore[arg-type]
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return deltas, parser.message()


def test_only_required_and_a_named_function_force_a_call() -> None:
    assert ForcedToolChoice.of(TOOLS, "auto", None) is None
    assert ForcedToolChoice.of(TOOLS, "none", None) is None
    assert ForcedToolChoice.of(TOOLS, None, None) is None
    named = ForcedToolChoice.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named is not None and named.json_schema() == WEATHER["parameters"]


def test_required_schema_is_an_array_of_the_tools_calls() -> None:
    choice = ForcedToolChoice.of(TOOLS, "required", None)
    assert choice is not None
    schema = choice.json_schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    # A function without parameters takes an object.
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    single = ForcedToolChoice.of(TOOLS, "required", parallel_tool_calls=False)
    assert single is not None and single.json_schema()["maxItems"] == 1


@pytest.mark.parametrize("piece_size", [1, 4, 100])
def test_a_named_call_streams_its_arguments_and_the_deltas_join_to_the_message(piece_size: int) -> None:
    arguments = '{"city": "Paris, \\u00eele-de-France"}'
    pieces = [arguments[i:i + piece_size] for i in range(0, len(arguments), piece_size)]
    choice = ForcedToolChoice.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert choice is not None
    deltas, message = _run(choice, pieces)
    assert deltas[0].tool_calls[0].name == "get_weather" and deltas[0].tool_calls[0].id == "call_0"
    assert all(call.name is None for delta in deltas[1:] for call in delta.tool_calls)
    assert AssistantMessage.from_deltas(deltas) == message
    assert message.content is None
    assert [(c.id, c.name, c.arguments) for c in message.tool_calls] == [("call_0", "get_weather", arguments)]


def test_required_calls_are_released_whole_at_the_end() -> None:
    output = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    choice = ForcedToolChoice.of(TOOLS, "required", None)
    assert choice is not None
    deltas, message = _run(choice, [output[:10], output[10:]])
    assert all(d.is_empty for d in deltas[:-1])
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert AssistantMessage.from_deltas(deltas) == message


@pytest.mark.parametrize(("output", "names"), [
    ('[{"name": "get_weather", "parame', []),
    ('', []),
    ('[\n  {"name": "get_time", "parameters": {}},\n  {"name": "get_weather", "parameters": {"ci', ["get_time"]),
    ('[{"name": "get_time", "parameters": {}}', ["get_time"]),
    ('{"name": "get_time"}', []),
])
def test_required_output_cut_short_gives_its_whole_calls_and_no_text(output: str,
                                                                    names: list[str]) -> None:
    """What a choice cut short by max_tokens leaves. Its JSON came back as the message's text,
    the schema's wrapper shown to the user as if the model had written it."""
    choice = ForcedToolChoice.of(TOOLS, "required", None)
    assert choice is not None
    deltas, message = _run(choice, [output])
    assert message.content is None and [call.name for call in message.tool_calls] == names
    assert AssistantMessage.from_deltas(deltas) == message


def test_required_output_nested_past_the_recursion_limit_gives_no_call() -> None:
    """A `[[[[` loop cut by max_tokens: json.loads raised RecursionError (a 500)."""
    output = '[{"name": "get_weather", "parameters": {"city": ' + "[" * 5000
    choice = ForcedToolChoice.of(TOOLS, "required", None)
    assert choice is not None
    deltas, message = _run(choice, [output])
    assert message == AssistantMessage()
    assert AssistantMessage.from_deltas(deltas) == message


def test_required_call_with_a_lone_surrogate_escape_is_sendable() -> None:
    output = '[{"name": "get_weather", "parameters": {"city": "Paris \\ud83d"}}]'
    choice = ForcedToolChoice.of(TOOLS, "required", None)
    assert choice is not None
    _, message = _run(choice, [output])
    # The gateway sends the message as UTF-8 JSON; this raised UnicodeEncodeError (a 500).
    json.dumps(message.to_dict(), ensure_ascii=False).encode("utf-8")
    assert [json.loads(call.arguments) for call in message.tool_calls] == [{"city": "Paris \ud83d"}]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("piece_size", [1, 3, 1000])
@pytest.mark.parametrize("reasoning_parser", ["deepseek_v4", "glm45", "qwen3"])
def test_reasoning_before_the_forced_calls_is_reasoning(piece_size: int, reasoning_parser: str) -> None:
    """Thinking on: the engine leaves the reasoning free and holds what follows to the calls."""
    calls = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    required = ForcedToolChoice.of(TOOLS, "required", None)
    assert required is not None
    deltas, message = _run(required, _pieces(f"Oslo, then.</think>\n\n{calls}", piece_size),
                           reasoning_parser)
    assert message.reasoning_content == "Oslo, then." and message.content is None
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert AssistantMessage.from_deltas(deltas) == message
    named = ForcedToolChoice.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named is not None
    deltas, message = _run(named, _pieces('Oslo, then.</think>{"city": "Oslo"}', piece_size),
                           reasoning_parser)
    assert message.reasoning_content == "Oslo, then."
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert AssistantMessage.from_deltas(deltas) == message


def test_reasoning_cut_short_leaves_no_call() -> None:
    required = ForcedToolChoice.of(TOOLS, "required", None)
    assert required is not None
    deltas, message = _run(required, ["Let me think about", " the city"], "deepseek_v4")
    assert message == AssistantMessage(reasoning_content="Let me think about the city")
    assert AssistantMessage.from_deltas(deltas) == message
