"""GLM-4.7 / GLM-5.x tool calls (`glm47`).

Each call is one element; the function name comes right after the opening tag, then key/value
pairs, with or without newlines between them (GLM-4.5 wrote newlines, GLM-4.7 does not)::

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>

Values are written as text for strings and as JSON otherwise, with nothing in the markup saying
which, so the tool schema decides. String values are kept verbatim (no trimming). The turn ends
with `<|observation|>` (tool results follow) or `<|user|>`. As in vLLM's `glm47` parser, a call to
a tool the request did not declare is dropped: the name is whatever text follows `<tool_call>`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from services.gateway.parsing.argument_typing import RawArgument
from services.gateway.parsing.formats import ParsedCall, ToolCallFormat

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_KEY_START = "<arg_key>"
_KEY_END = "</arg_key>"
_VALUE_END = "</arg_value>"
_VALUE_START = re.compile(r"\s*<arg_value>")


def parse_tool_call(text: str) -> ParsedCall | None:
    body = text.removeprefix(CALL_START)
    name_end = body.find(_KEY_START)
    name = (body if name_end < 0 else body[:name_end]).strip()
    if not name or "<" in name or ">" in name:
        return None
    return ParsedCall(name=name, arguments=tuple(_arguments(body, max(name_end, 0))))


def _arguments(body: str, position: int) -> Iterator[RawArgument]:
    """Each `<arg_key>K</arg_key><arg_value>V</arg_value>` pair, in one pass over the body.

    A pair runs from its key tag to the first closing tags after it; a key not followed by a
    value is skipped. A regular expression with lazy groups would retry every unclosed tag
    against the rest of the call, which takes minutes on a few tens of kilobytes.
    """
    while (key_start := body.find(_KEY_START, position)) >= 0:
        key_text_start = key_start + len(_KEY_START)
        key_end = body.find(_KEY_END, key_text_start)
        if key_end < 0:
            return
        value_start = _VALUE_START.match(body, key_end + len(_KEY_END))
        if value_start is None:
            position = key_end + len(_KEY_END)
            continue
        value_end = body.find(_VALUE_END, value_start.end())
        if value_end < 0:
            return
        key = body[key_text_start:key_end].strip()
        yield RawArgument(name=key, text=body[value_start.end() : value_end])
        position = value_end + len(_VALUE_END)


GLM47_FORMAT = ToolCallFormat(
    name="glm47",
    call_starts=(CALL_START,),
    call_ends=(CALL_END,),
    parse_call=parse_tool_call,
    terminators=("<|user|>", "<|observation|>", "<|system|>", "<|assistant|>", "<|endoftext|>"),
    drops_undeclared_tools=True,
    value_starts=(_KEY_START,),
    value_ends=(_VALUE_END,),
    starts_ending_reasoning=(CALL_START,),
)
