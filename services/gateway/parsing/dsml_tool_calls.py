"""DeepSeek-V4 tool calls (`deepseek_v4`): DSML, DeepSeek's markup language.

The bar in every tag is the full-width U+FF5C; the brackets are ASCII. One block holds all calls,
with a newline between elements::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`string="true"` means the value is the text as written; `string="false"` means it is JSON.
The attribute is sometimes missing (then it is read as `string="false"`, as vLLM reads it: JSON
when it parses, else text), the block tag is
sometimes spelt `<｜DSML｜toolcalls>` or `<｜DSML｜tool>`, and an `invoke` sometimes comes without
the block or without its closing tag (before `</｜DSML｜tool_calls>` or the next `invoke`); all are
accepted, but inside the reasoning only the block starts calls (a bare `invoke` there is the
reasoning's text, as vLLM reads it).
In the prompt the assistant turn is `reasoning</think>content` + `\\n\\n` + block + EOS, so the
block ends the turn.
"""

from __future__ import annotations

import re

from services.gateway.parsing.argument_typing import RawArgument
from services.gateway.parsing.formats import ParsedCall, ToolCallFormat

_BAR = "\uff5c"
_DSML = f"{_BAR}DSML{_BAR}"
BLOCK_START = f"<{_DSML}tool_calls>"
BLOCK_END = f"</{_DSML}tool_calls>"
INVOKE_START = f"<{_DSML}invoke"
INVOKE_END = f"</{_DSML}invoke>"
PARAMETER_START = f"<{_DSML}parameter"
PARAMETER_END = f"</{_DSML}parameter>"
END_OF_SENTENCE = f"<{_BAR}end\u2581of\u2581sentence{_BAR}>"
USER_TURN = f"<{_BAR}User{_BAR}>"

_INVOKE_HEAD = re.compile(rf'{re.escape(INVOKE_START)}\s+name="([^"]*)"\s*>')
# A parameter ends at its closing tag or, when that is missing, where the next one begins.
_PARAMETER = re.compile(
    rf'{re.escape(PARAMETER_START)}\s+name="([^"]*)"(?:\s+string="([^"]*)")?\s*>'
    rf"(.*?)(?:{re.escape(PARAMETER_END)}|(?={re.escape(PARAMETER_START)})|\Z)",
    re.DOTALL,
)


def parse_invoke(text: str) -> ParsedCall | None:
    head = _INVOKE_HEAD.match(text)
    if head is None or not head.group(1).strip():
        return None
    arguments = tuple(
        RawArgument(
            name=match.group(1),
            text=match.group(3),
            # Anything but string="true", a missing attribute too, is JSON to vLLM.
            encoding="text" if match.group(2) == "true" else "json",
        )
        for match in _PARAMETER.finditer(text, head.end())
    )
    return ParsedCall(name=head.group(1).strip(), arguments=arguments)


_BLOCK_STARTS = (BLOCK_START, f"<{_DSML}toolcalls>", f"<{_DSML}tool>")

DSML_FORMAT = ToolCallFormat(
    name="deepseek_v4",
    call_starts=(INVOKE_START,),
    call_ends=(INVOKE_END, BLOCK_END),
    parse_call=parse_invoke,
    block_starts=_BLOCK_STARTS,
    block_ends=(BLOCK_END,),
    terminators=(END_OF_SENTENCE, USER_TURN),
    call_restarts=(INVOKE_START,),
    value_starts=(PARAMETER_START,),
    value_ends=(PARAMETER_END,),
    starts_ending_reasoning=_BLOCK_STARTS,
)
