"""Qwen3 XML tool calls (`qwen3_xml`, the Qwen3-Coder / Qwen3.x format).

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The template wraps each value in one newline on each side; those two newlines are markup and
are removed, anything else is kept. Values carry no type, so the tool schema decides. Accepted
deviations seen from these models: `<function=...>` without `<tool_call>`, a missing
`</parameter>` (the value then ends where the next parameter or the function ends), a missing
`</function>` or `</tool_call>`, and the older Hermes form
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Inside a parameter value only
`</function>` ends the call: a `</tool_call>` there is the value's text (an agent writing a file
about this very format), as in vLLM's qwen3 parser. Inside the reasoning only `<tool_call>` starts
a call; a bare `<function=...>` there is the reasoning's text, as vLLM reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from services.gateway.parsing.argument_typing import RawArgument
from services.gateway.parsing.formats import ParsedCall, ToolCallFormat

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"

# Names stop at `<` too: otherwise each of many unclosed `<function=` or `<parameter=` heads
# scans to the end of the call (quadratic time); no name contains one.
_FUNCTION_HEAD = re.compile(r"<function=([^<>\n]*)>")
_PARAMETER = re.compile(
    r"<parameter=([^<>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL
)


def _trim_template_newlines(value: str) -> str:
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _parse_hermes_json(text: str) -> ParsedCall | None:
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):  # deep nesting raises the latter
        return None
    if (
        not isinstance(call, Mapping)
        or not isinstance(call.get("name"), str)
        or not call["name"].strip()
    ):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, Mapping):
        return None
    return ParsedCall(
        name=call["name"].strip(),
        arguments=tuple(
            RawArgument(name=str(key), text=json.dumps(value, ensure_ascii=False), encoding="json")
            for key, value in arguments.items()
        ),
    )


def parse_tool_call(text: str) -> ParsedCall | None:
    head = _FUNCTION_HEAD.search(text)
    if head is None:
        return _parse_hermes_json(text.removeprefix(CALL_START).strip())
    name = head.group(1).strip()
    if not name:
        return None
    arguments = tuple(
        RawArgument(name=match.group(1).strip(), text=_trim_template_newlines(match.group(2)))
        for match in _PARAMETER.finditer(text, head.end())
    )
    return ParsedCall(name=name, arguments=arguments)


QWEN3_XML_FORMAT = ToolCallFormat(
    name="qwen3_xml",
    call_starts=(CALL_START, FUNCTION_START),
    call_ends=(FUNCTION_END, CALL_END),
    parse_call=parse_tool_call,
    terminators=("<|im_end|>", "<|im_start|>", "<|endoftext|>"),
    value_starts=(PARAMETER_START,),
    value_ends=(PARAMETER_END,),
    call_ends_outside_values=(CALL_END,),
    starts_ending_reasoning=(CALL_START,),
)
