"""Qwen3 XML: `<tool_call><function=NAME><parameter=K>v</parameter></function></tool_call>`."""

from __future__ import annotations

import json
from typing import Any

from tests.parsing.streaming_harness import arguments_of, parse_every_way

QWEN = {"tool_call_parser": "qwen3_xml", "reasoning_parser": "qwen3"}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "str_replace_editor",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "enum": ["view", "create", "str_replace"]},
                    "path": {"type": "string"},
                    "file_text": {"type": "string"},
                    "view_range": {"type": "array", "items": {"type": "integer"}},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "http_request",
            "parameters": {
                "type": "object",
                "properties": {
                    "url": {"type": "string"},
                    "retries": {"type": "integer"},
                    "body": {"type": "object"},
                    "follow_redirects": {"type": "boolean"},
                    "timeout": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                },
            },
        },
    },
]

HTML = '<html>\n  <body class="main">\n    <p>It\'s "quoted" & <b>bold</b></p>\n  </body>\n</html>'


def _param(key: str, value: str) -> str:
    return f"<parameter={key}>\n{value}\n</parameter>\n"


REALISTIC_OUTPUT = (
    "The user wants an HTML file, then a POST.\nI'll use <two> tools.\n</think>\n\n"
    "Creating the page and notifying the server.\n\n"
    "<tool_call>\n<function=str_replace_editor>\n"
    + _param("command", "create")
    + _param("path", "/srv/www/index.html")
    + _param("file_text", HTML)
    + "</function>\n</tool_call>\n"
    "<tool_call>\n<function=http_request>\n"
    + _param("url", "https://example.test/notify?a=1&b=<2>")
    + _param("retries", "3")
    + _param(
        "body",
        '{"event": "created", "meta": {"paths": ["/index.html"], "size": 87, "draft": null}}',
    )
    + _param("follow_redirects", "True")
    + _param("timeout", "null")
    + "</function>\n</tool_call><|im_end|>"
)


def test_realistic_thinking_output_with_two_calls() -> None:
    message = parse_every_way(REALISTIC_OUTPUT, tools=TOOLS, thinking=True, **QWEN)

    assert (
        message.reasoning_content
        == "The user wants an HTML file, then a POST.\nI'll use <two> tools."
    )
    assert message.content == "Creating the page and notifying the server."
    assert arguments_of(message) == [
        (
            "str_replace_editor",
            {"command": "create", "path": "/srv/www/index.html", "file_text": HTML},
        ),
        (
            "http_request",
            {
                "url": "https://example.test/notify?a=1&b=<2>",
                "retries": 3,
                "body": {
                    "event": "created",
                    "meta": {"paths": ["/index.html"], "size": 87, "draft": None},
                },
                "follow_redirects": True,
                "timeout": None,
            },
        ),
    ]


def test_only_the_template_newlines_around_a_value_are_removed() -> None:
    output = (
        "<tool_call>\n<function=str_replace_editor>\n"
        + _param("file_text", "\n\nindented\n\n")
        + "</function>\n</tool_call>"
    )
    message = parse_every_way(output, tools=TOOLS, thinking=False, **QWEN)

    assert arguments_of(message) == [("str_replace_editor", {"file_text": "\n\nindented\n\n"})]


def test_chat_mode_with_empty_think_block_written_by_the_model() -> None:
    output = "<think>\n\n</think>\n\nHello! How can I help?<|im_end|>"
    message = parse_every_way(output, thinking=False, **QWEN)

    assert message.reasoning_content is None
    assert message.content == "Hello! How can I help?"


def test_deviations_function_without_tool_call_and_missing_closers() -> None:
    output = (
        "<function=str_replace_editor>\n<parameter=command>\nview\n"
        "<parameter=view_range>\n[1, 20]\n</function>\n"
        "<tool_call>\n<function=http_request>\n" + _param("url", "http://a.test") + "</tool_call>"
    )
    message = parse_every_way(output, tools=TOOLS, thinking=False, **QWEN)

    assert arguments_of(message) == [
        ("str_replace_editor", {"command": "view", "view_range": [1, 20]}),
        ("http_request", {"url": "http://a.test"}),
    ]


def test_hermes_json_body_is_accepted() -> None:
    call = {"name": "http_request", "arguments": {"url": "http://a.test", "retries": "2"}}
    output = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    message = parse_every_way(output, tools=TOOLS, thinking=False, **QWEN)

    assert arguments_of(message) == [("http_request", {"url": "http://a.test", "retries": 2})]


def test_cut_inside_a_parameter_value_releases_no_call() -> None:
    cut = REALISTIC_OUTPUT.index("<b>bold")
    message = parse_every_way(REALISTIC_OUTPUT[:cut], tools=TOOLS, thinking=True, **QWEN)

    assert message.content == "Creating the page and notifying the server."
    assert not message.has_tool_calls


def test_hermes_json_nested_past_the_recursion_limit_is_no_call_and_no_error() -> None:
    output = (
        'Calling.<tool_call>\n{"name": "http_request", "arguments": {"body": '
        + "[" * 100_000
        + "}}\n</tool_call>"
    )
    message = parse_every_way(output, tools=TOOLS, thinking=False, **QWEN)

    # json.loads raised RecursionError, which escaped the parser (a 500).
    assert message.content == "Calling."
    assert not message.has_tool_calls
