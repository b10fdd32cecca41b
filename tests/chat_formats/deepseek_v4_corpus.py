"""Conversations for the DeepSeek-V4 encoding tests: OpenAI-shaped requests as clients send them."""

from __future__ import annotations

import json
from typing import Any

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
# Keys in a non-OpenAI order, no description, `strict` set: vLLM re-serializes all of that.
SEARCH_TOOL = {
    "function": {
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
        "strict": True,
        "name": "search_docs",
    },
    "type": "function",
}
BARE_TOOL = {"type": "function", "function": {"name": "now"}}
WRITE_TOOL = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Écrit un fichier — unicode in the schema.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "options": {"type": "object"},
                "mode": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    encoded = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": encoded}}


def _tool(call_id: str, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# name -> (messages, tools)
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "single_user": ([{"role": "user", "content": "What is 2+2?"}], None),
    "system_and_user": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ], None),
    "multi_turn_reasoning_history": ([
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did...", "reasoning": "Pick a pun."},
        {"role": "user", "content": "Another?"},
    ], None),
    "content_part_lists": ([
        {"role": "system", "content": [{"type": "text", "text": "Rule one."}, {"type": "text", "text": "Rule two."}]},
        {"role": "user", "content": [{"type": "text", "text": "Part A"}, {"type": "text", "text": "Part B"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Ans 1"}, {"type": "text", "text": "Ans 2"}]},
        {"role": "user", "content": [{"type": "text", "text": ""}]},
    ], None),
    "tools_without_system": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL]),
    "tools_with_system": ([
        {"role": "system", "content": "You call tools when useful."},
        {"role": "user", "content": "Find docs on KV cache."},
    ], [WEATHER_TOOL, SEARCH_TOOL, BARE_TOOL]),
    "tool_round_trip": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
         "tool_calls": [_call("call_1", "get_weather", {"city": "Paris", "unit": "c"})]},
        _tool("call_1", '{"temp": 21, "sky": "clear"}'),
    ], [WEATHER_TOOL]),
    "parallel_results_out_of_order": ([
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Paris, Rome and Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Three calls.",
         "tool_calls": [_call("a", "get_weather", {"city": "Paris"}), _call("b", "get_weather", {"city": "Rome"}),
                        _call("c", "get_weather", {"city": "Oslo"})]},
        _tool("c", "Oslo: 3"), _tool("a", "Paris: 21"), _tool("b", "Rome: 25"),
    ], [WEATHER_TOOL]),
    "two_tool_rounds_then_new_question": ([
        {"role": "user", "content": "Search then summarize."},
        {"role": "assistant", "content": "", "reasoning_content": "Search first.",
         "tool_calls": [_call("s1", "search_docs", {"query": "paged attention", "limit": 3})]},
        _tool("s1", "doc1\ndoc2"),
        {"role": "assistant", "content": None, "reasoning_content": "Refine.",
         "tool_calls": [_call("s2", "search_docs", {"query": "block tables"})]},
        _tool("s2", "doc3"),
        {"role": "assistant", "content": "Summary: blocks.", "reasoning_content": "Done."},
        {"role": "user", "content": "Thanks. And prefix caching?"},
    ], [SEARCH_TOOL]),
    "tool_result_then_user_text": ([
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("t", "now", {})]},
        _tool("t", "12:00"),
        {"role": "user", "content": "Also say hi."},
    ], [BARE_TOOL]),
    "awkward_argument_values": ([
        {"role": "user", "content": "Write it."},
        {"role": "assistant", "content": "Writing.", "reasoning_content": "Values of every JSON type.",
         "tool_calls": [_call("w", "write_file", {
             "path": "a/<b>.txt", "content": 'line "one"\n<tag attr="x">\n  indented ‘ünïcode’',
             "options": {"nested": {"deep": [1, 2.5, None, True]}, "flag": False},
             "mode": 644, "tags": ["x", "y"], "missing": None, "leading_zero": "007"})]},
        _tool("w", "ok"),
    ], [WRITE_TOOL]),
    "developer_messages": ([
        {"role": "developer", "content": "Early developer note."},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "developer", "content": "Late developer note."},
        {"role": "user", "content": "Q2"},
    ], None),
    "ends_with_assistant": ([
        {"role": "user", "content": "Say yes."},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "Easy."},
    ], None),
    "mid_conversation_system": ([
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "system", "content": "New instructions."},
        {"role": "user", "content": "Q2"},
    ], None),
    "trailing_system": ([
        {"role": "user", "content": "Q1"},
        {"role": "system", "content": "Answer in French."},
    ], None),
    "malformed_history_arguments": ([
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": None,
         "tool_calls": [_call("m1", "now", "{not json"), _call("m2", "now", ""), _call("m3", "now", "[1, 2]")]},
        _tool("m1", "x"), _tool("m2", "y"), _tool("m3", "z"),
    ], [BARE_TOOL]),
    "tool_content_parts": ([
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "tool_calls": [_call("p", "search_docs", {"query": "q"})]},
        _tool("p", [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]),
    ], [SEARCH_TOOL]),
    "both_reasoning_fields": ([
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning": "kept", "reasoning_content": "ignored"},
        {"role": "user", "content": "Q again"},
    ], [WEATHER_TOOL]),
    "tools_listed_never_called": ([
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "no tool needed"},
        {"role": "user", "content": "Bye"},
    ], [WEATHER_TOOL]),
    "results_with_unknown_ids": ([
        {"role": "user", "content": "Three lookups."},
        {"role": "assistant", "content": None, "tool_calls": [
            _call("k1", "get_weather", {"city": "A"}), _call("k2", "get_weather", {"city": "B"}),
            _call("k3", "get_weather", {"city": "C"})]},
        _tool("k3", "C: 3"), _tool("stale", "?"), _tool("k1", "A: 1"),
    ], [WEATHER_TOOL]),
    "assistant_content_null": ([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Still there?"},
    ], None),
    "tool_message_without_id": ([
        {"role": "user", "content": "Ping."},
        {"role": "assistant", "content": None, "tool_calls": [_call("q", "now", {})]},
        {"role": "tool", "content": "pong"},
    ], [BARE_TOOL]),
}

# Template kwargs as clients put them in `chat_template_kwargs`: default, both modes, every effort.
TEMPLATE_KWARGS: dict[str, dict[str, Any]] = {
    "default": {},
    "chat": {"thinking": False},
    "chat_enable_thinking_false": {"enable_thinking": False},
    "thinking": {"thinking": True},
    "enable_thinking": {"enable_thinking": True},
    "effort_none": {"reasoning_effort": "none"},
    "effort_minimal": {"thinking": True, "reasoning_effort": "minimal"},
    "effort_low": {"thinking": True, "reasoning_effort": "low"},
    "effort_medium": {"reasoning_effort": "medium"},
    "effort_high": {"thinking": True, "reasoning_effort": "high"},
    "effort_xhigh": {"reasoning_effort": "xhigh"},
    "effort_max": {"thinking": True, "reasoning_effort": "max"},
    "chat_with_max": {"thinking": False, "reasoning_effort": "max"},
    "keep_all_reasoning": {"thinking": True, "drop_thinking": False},
}
