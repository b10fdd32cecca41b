"""The official openai SDK accumulates our streamed deltas into the right tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.parsing import MessageDelta
from tests.parsing.streaming_harness import chunks_of, stream
from tests.parsing.test_deepseek_v4_parsing import REALISTIC_OUTPUT, TOOLS

openai_streaming = pytest.importorskip("openai.lib.streaming.chat")
openai_chunk_types = pytest.importorskip("openai.types.chat")


def _chunk(delta: MessageDelta, finish_reason: str | None) -> Any:
    return openai_chunk_types.ChatCompletionChunk.model_validate(
        {
            "id": "chatcmpl-test",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "deepseek-v4-flash",
            "choices": [{"index": 0, "delta": delta.to_dict(), "finish_reason": finish_reason}],
        }
    )


@pytest.mark.parametrize("chunk_size", [1, 5, len(REALISTIC_OUTPUT)])
def test_sdk_stream_state_rebuilds_the_tool_calls(chunk_size: int) -> None:
    deltas, message = stream(
        chunks_of(REALISTIC_OUTPUT, chunk_size),
        tool_call_parser="deepseek_v4",
        reasoning_parser="deepseek_v4",
        tools=TOOLS,
        thinking=True,
    )
    state = openai_streaming.ChatCompletionStreamState()
    for delta in deltas[:-1]:
        state.handle_chunk(_chunk(delta, None))
    state.handle_chunk(_chunk(deltas[-1], "tool_calls" if message.has_tool_calls else "stop"))

    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == message.content
    sdk_calls = [
        (call.id, call.function.name, json.loads(call.function.arguments))
        for call in choice.message.tool_calls
    ]
    assert sdk_calls == [
        (call.id, call.name, json.loads(call.arguments)) for call in message.tool_calls
    ]
    assert [name for _, name, _ in sdk_calls] == ["write_file", "search"]
