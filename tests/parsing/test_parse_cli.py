"""`backport parse` (run as `python -m services.gateway.parsing.cli`) in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.parsing.test_deepseek_v4_parsing import PYTHON_SOURCE, REALISTIC_OUTPUT, TOOLS

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_parse(arguments: list[str], stdin: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "services.gateway.parsing.cli", *arguments],
        input=stdin.encode("utf-8"),
        capture_output=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )


@pytest.fixture
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS), encoding="utf-8")
    return path


@pytest.mark.parametrize("chunk_arguments", [[], ["--chunk-size", "1"], ["--chunk-size", "13"]])
def test_prints_the_message_for_every_chunk_size(
    tools_file: Path, chunk_arguments: list[str]
) -> None:
    result = _run_parse(
        [
            "--tool-call-parser",
            "deepseek_v4",
            "--reasoning-parser",
            "deepseek_v4",
            "--tools",
            str(tools_file),
            *chunk_arguments,
        ],
        REALISTIC_OUTPUT,
    )

    assert result.returncode == 0, result.stderr.decode()
    printed: dict[str, Any] = json.loads(result.stdout)
    assert printed["content"] == "I'll write the file and look up related code."
    assert printed["reasoning_content"].startswith("The user wants a file")
    assert [call["function"]["name"] for call in printed["tool_calls"]] == ["write_file", "search"]
    assert all(
        call["type"] == "function" and call["id"].startswith("call_")
        for call in printed["tool_calls"]
    )
    first_arguments = json.loads(printed["tool_calls"][0]["function"]["arguments"])
    assert first_arguments["content"] == PYTHON_SOURCE
    assert json.loads(printed["tool_calls"][1]["function"]["arguments"])["agent_id"] == "007"


def test_tools_file_may_be_a_whole_request_body(tmp_path: Path) -> None:
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps({"model": "m", "messages": [], "tools": TOOLS}))
    output = REALISTIC_OUTPUT.replace('string="true">3<', 'string="true">0003<')

    result = _run_parse(["--tool-call-parser", "deepseek_v4", "--tools", str(request_file)], output)

    assert result.returncode == 0, result.stderr.decode()
    arguments = json.loads(json.loads(result.stdout)["tool_calls"][1]["function"]["arguments"])
    assert arguments["limit"] == 3


def test_no_thinking_reads_the_output_as_content() -> None:
    result = _run_parse(["--reasoning-parser", "qwen3", "--no-thinking"], "Just an answer.</think>")

    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout) == {
        "role": "assistant",
        "reasoning": None,
        "reasoning_content": None,
        "content": "Just an answer.",
        "tool_calls": [],
    }


def test_thinking_is_the_default() -> None:
    result = _run_parse(["--reasoning-parser", "glm45"], "Hmm.</think>Yes.")

    printed = json.loads(result.stdout)
    assert (printed["reasoning_content"], printed["content"]) == ("Hmm.", "Yes.")


@pytest.mark.parametrize(
    "arguments",
    [
        ["--tool-call-parser", "hermes"],
        ["--chunk-size", "0"],
        ["--tools", "/nonexistent/tools.json"],
    ],
)
def test_bad_options_exit_with_status_2(arguments: list[str]) -> None:
    result = _run_parse(arguments, "text")

    assert result.returncode == 2
    assert result.stderr


@pytest.mark.parametrize(("cut_short", "calls"), [([], ["write"]), (["--cut-short"], [])])
def test_a_call_left_open_is_released_unless_the_output_was_cut_short(
    tmp_path: Path, cut_short: list[str], calls: list[str]
) -> None:
    from tests.parsing.test_parser_parity_gaps import UNCLOSED_CALLS, WRITE_TOOL

    tools = tmp_path / "write.json"
    tools.write_text(json.dumps(WRITE_TOOL), encoding="utf-8")
    result = _run_parse(
        ["--tool-call-parser", "deepseek_v4", "--reasoning-parser", "deepseek_v4",
         "--tools", str(tools), *cut_short],
        UNCLOSED_CALLS["deepseek_v4"][0],
    )
    assert result.returncode == 0, result.stderr.decode()
    printed = json.loads(result.stdout)
    assert [call["function"]["name"] for call in printed.get("tool_calls", [])] == calls
