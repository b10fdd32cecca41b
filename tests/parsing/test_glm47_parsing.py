"""GLM-4.7 / GLM-5.x: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`."""

from __future__ import annotations

from typing import Any

from tests.parsing.streaming_harness import arguments_of, parse_every_way

GLM = {"tool_call_parser": "glm47", "reasoning_parser": "glm45"}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout_s": {"type": "integer"},
                    "env": {"type": "object"},
                    "dry_run": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                    "lines": {"type": "array"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
]

SHELL = 'grep -rn "<tool>" src/ | awk \'{print $1}\' > out.txt\necho "done"'
NEW_CODE = 'if a < b:\n    print("a < b")\n'


def _arg(key: str, value: str) -> str:
    return f"<arg_key>{key}</arg_key><arg_value>{value}</arg_value>"


REALISTIC_OUTPUT = (
    '<think>Run the search, then fix the comparison.\nCareful with "quotes" & <tags>.</think>'
    "\nI'll search first and edit the file.\n"
    "<tool_call>run_shell"
    + _arg("command", SHELL)
    + _arg("timeout_s", "30")
    + _arg("env", '{"LANG": "C", "PATH": {"prepend": ["/opt/bin"]}}')
    + _arg("dry_run", "false")
    + "</tool_call>"
    "<tool_call>edit\n"
    + _arg("old", "if a > b:")
    + "\n"
    + _arg("new", NEW_CODE)
    + "\n"
    + _arg("lines", "[3, 4]")
    + "\n"
    + _arg("note", "null")
    + "\n</tool_call><|observation|>"
)


def test_realistic_output_with_two_calls_model_opens_think() -> None:
    message = parse_every_way(REALISTIC_OUTPUT, tools=TOOLS, thinking=False, **GLM)

    assert (
        message.reasoning_content
        == 'Run the search, then fix the comparison.\nCareful with "quotes" & <tags>.'
    )
    assert message.content == "I'll search first and edit the file."
    assert arguments_of(message) == [
        (
            "run_shell",
            {
                "command": SHELL,
                "timeout_s": 30,
                "env": {"LANG": "C", "PATH": {"prepend": ["/opt/bin"]}},
                "dry_run": False,
            },
        ),
        ("edit", {"old": "if a > b:", "new": NEW_CODE, "lines": [3, 4], "note": None}),
    ]


def test_prompt_opened_think_glm53_style() -> None:
    # GLM-5.3 always ends the prompt with <think>: the output carries only the closing tag.
    output = "Simple question.</think>The answer is 42.<|user|>"
    message = parse_every_way(output, thinking=True, **GLM)

    assert message.reasoning_content == "Simple question."
    assert message.content == "The answer is 42."


def test_call_without_arguments_and_strings_kept_verbatim() -> None:
    output = (
        "<tool_call>list_files</tool_call><tool_call>echo"
        + _arg("text", "  007  ")
        + "</tool_call>"
    )
    message = parse_every_way(output, thinking=False, **GLM)

    assert arguments_of(message) == [("list_files", {}), ("echo", {"text": "  007  "})]


def test_parameters_of_a_tool_without_schema_keep_their_text() -> None:
    # Nothing says "3" is a number rather than a string; vLLM keeps the text too.
    output = (
        "<tool_call>anything"
        + _arg("n", "3")
        + _arg("flag", "true")
        + _arg("word", "hello")
        + "</tool_call>"
    )
    message = parse_every_way(output, thinking=False, **GLM)

    assert arguments_of(message) == [("anything", {"n": "3", "flag": "true", "word": "hello"})]


def test_tool_call_inside_reasoning_ends_it_and_cut_call_is_dropped() -> None:
    output = (
        "Need to run it.<tool_call>run_shell"
        + _arg("command", "ls")
        + "</tool_call><tool_call>edit"
        + _arg("old", "x")
    )
    message = parse_every_way(output, tools=TOOLS, thinking=True, **GLM)

    assert message.reasoning_content == "Need to run it."
    assert message.content is None
    assert arguments_of(message) == [("run_shell", {"command": "ls"})]


def test_a_call_with_no_name_is_dropped() -> None:
    message = parse_every_way(
        "Hi.<tool_call>" + _arg("a", "1") + "</tool_call>", thinking=False, **GLM
    )

    assert message.content == "Hi."
    assert not message.has_tool_calls


def test_a_call_to_a_tool_the_request_did_not_declare_is_dropped_as_vllm_does() -> None:
    output = (
        "Let me check.<tool_call>read_file" + _arg("path", "a.txt") + "</tool_call>"
        "<tool_call>run_shell" + _arg("command", "ls") + "</tool_call>"
    )
    message = parse_every_way(output, tools=TOOLS, thinking=False, **GLM)

    # vLLM's glm47 parser validates names against the tools (`validate_tool_names=True`).
    assert message.content == "Let me check."
    assert arguments_of(message) == [("run_shell", {"command": "ls"})]
    assert [call.id for call in message.tool_calls] == ["call_0"]
