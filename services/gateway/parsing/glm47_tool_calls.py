"""GLM-4.7 / GLM-5.x tool calls (`glm47`).

Each call is one element; the function name comes right after the opening tag, then key/value
pairs, with or without newlines between them (GLM-4.5 wrote newlines, GLM-4.7 does not)::

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>

Values are written as text for strings and as JSON otherwise, with nothing in the markup saying
which, so the tool schema decides. String values are kept verbatim (no trimming). The turn ends
with `<|observation|>` (tool results follow) or `<|user|>`.
"""

from __future__ import annotations

import re

from services.gateway.parsing.argument_typing import RawArgument
from services.gateway.parsing.formats import ParsedCall, ToolCallFormat

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_FIRST_KEY = "<arg_key>"
_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_tool_call(text: str) -> ParsedCall | None:
    body = text.removeprefix(CALL_START)
    name_end = body.find(_FIRST_KEY)
    name = (body if name_end < 0 else body[:name_end]).strip()
    if not name or "<" in name or ">" in name:
        return None
    arguments = tuple(
        RawArgument(name=match.group(1).strip(), text=match.group(2))
        for match in _ARGUMENT.finditer(body, max(name_end, 0))
    )
    return ParsedCall(name=name, arguments=arguments)


GLM47_FORMAT = ToolCallFormat(
    name="glm47",
    call_starts=(CALL_START,),
    call_ends=(CALL_END,),
    parse_call=parse_tool_call,
    terminators=("<|user|>", "<|observation|>", "<|system|>", "<|assistant|>", "<|endoftext|>"),
)
