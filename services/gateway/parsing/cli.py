"""`backport parse`: parse raw model output from stdin and print the assistant message as JSON.

Example::

    printf 'Let me look.</think>\\n\\n<｜DSML｜tool_calls>...' | \\
        python -m services.gateway.parsing.cli --tool-call-parser deepseek_v4 \\
            --reasoning-parser deepseek_v4 --tools tools.json --chunk-size 1

Without `--chunk-size` the text goes through in one piece (the non-streamed path); with it, in
N-character deltas through the streaming path, and the printed message is what an OpenAI client
would accumulate from the deltas. Exit status 2 on bad options or a bad tools file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from services.gateway.parsing.messages import AssistantMessage, MessageDelta, reasoning_fields
from services.gateway.parsing.output_parser import ChatOutputParser
from services.gateway.parsing.registry import REASONING_FORMATS, TOOL_CALL_FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_FORMATS), default=None)
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_FORMATS), default=None)
    parser.add_argument(
        "--tools", type=Path, default=None, help="JSON file holding the request's `tools` array"
    )
    parser.add_argument(
        "--no-thinking",
        action="store_true",
        help="the prompt was rendered in chat mode (it did not end with <think>)",
    )
    parser.add_argument(
        "--cut-short",
        action="store_true",
        help="the output was cut off (finish_reason length): a tool call left open is dropped, "
        "where by default the model ended it and it is released",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="N",
        help="feed the text through the streaming path in N-character deltas",
    )


def _load_tools(path: Path | None) -> list[dict[str, Any]] | None:
    if path is None:
        return None
    tools = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(tools, dict) and isinstance(tools.get("tools"), list):
        tools = tools["tools"]
    if not isinstance(tools, list):
        raise ValueError(
            "the tools file must hold a JSON array (or an object with a `tools` array)"
        )
    return tools


def run(args: argparse.Namespace) -> int:
    if args.chunk_size is not None and args.chunk_size < 1:
        print("error: --chunk-size must be at least 1", file=sys.stderr)
        return 2
    try:
        tools = _load_tools(args.tools)
    except (OSError, ValueError) as error:
        print(f"error: cannot read --tools: {error}", file=sys.stderr)
        return 2
    # Bytes in and out: model output is UTF-8 whatever the terminal's locale says.
    text = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    parser = ChatOutputParser(
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        tools=tools,
        thinking=not args.no_thinking,
    )
    chunk_size = args.chunk_size or max(len(text), 1)
    deltas: list[MessageDelta] = [
        parser.feed(text[start : start + chunk_size]) for start in range(0, len(text), chunk_size)
    ]
    deltas.append(parser.finish(model_stopped=not args.cut_short))
    message = AssistantMessage.from_deltas(deltas)
    printed = {
        "role": "assistant",
        **reasoning_fields(message.reasoning_content),
        "content": message.content,
        "tool_calls": [call.to_dict() for call in message.tool_calls],
    }
    sys.stdout.buffer.write(
        json.dumps(printed, ensure_ascii=False, indent=2).encode("utf-8") + b"\n"
    )
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="backport parse", description="Parse raw model output into an assistant message."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
