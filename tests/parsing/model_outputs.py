"""Raw model output as each family writes it, built from an expected message (test support).

Written from the formats' descriptions (field notes §6 and the parser module docstrings), so
the tests can generate outputs with hypothesis and compare the parse with what went in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.gateway.parsing.registry import REASONING_FORMATS, TOOL_CALL_FORMATS

BAR = "\uff5c"
DSML = f"{BAR}DSML{BAR}"
DEEPSEEK_EOS = f"<{BAR}end\u2581of\u2581sentence{BAR}>"
FAMILIES = ("deepseek_v4", "glm47", "qwen3_xml")
REASONING_PARSER_OF = {"deepseek_v4": "deepseek_v4", "glm47": "glm45", "qwen3_xml": "qwen3"}
END_OF_TURN = {"deepseek_v4": DEEPSEEK_EOS, "glm47": "<|observation|>", "qwen3_xml": "<|im_end|>"}


@dataclass(frozen=True)
class ExpectedCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ExpectedMessage:
    reasoning: str | None = None
    content: str | None = None
    calls: tuple[ExpectedCall, ...] = field(default_factory=tuple)


def all_markup() -> set[str]:
    """Every tag any parser recognises: none may appear in parsed content or reasoning."""
    tags: set[str] = set()
    for tool_format in TOOL_CALL_FORMATS.values():
        tags.update(tool_format.call_starts, tool_format.call_ends, tool_format.block_starts)
        tags.update(tool_format.block_ends, tool_format.terminators)
    for reasoning_format in REASONING_FORMATS.values():
        tags.update((reasoning_format.start, reasoning_format.end, *reasoning_format.terminators))
    tags.update(
        (f"<{DSML}parameter", f"</{DSML}parameter>", "<arg_key>", "</arg_key>", "</arg_value>")
    )
    tags.update(("<parameter=", "</parameter>"))
    return tags


def _as_text(value: Any) -> str:
    """Strings as written, everything else as JSON (what all three formats do)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _string_flag(value: Any) -> str:
    return "true" if isinstance(value, str) else "false"


def render_dsml_calls(calls: tuple[ExpectedCall, ...]) -> str:
    invokes = []
    for call in calls:
        parameters = "\n".join(
            f'<{DSML}parameter name="{key}" string="{_string_flag(value)}">'
            f"{_as_text(value)}</{DSML}parameter>"
            for key, value in call.arguments.items()
        )
        invokes.append(f'<{DSML}invoke name="{call.name}">\n{parameters}\n</{DSML}invoke>')
    return f"<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def render_glm47_calls(calls: tuple[ExpectedCall, ...]) -> str:
    return "".join(
        f"<tool_call>{call.name}"
        + "".join(
            f"<arg_key>{key}</arg_key><arg_value>{_as_text(value)}</arg_value>"
            for key, value in call.arguments.items()
        )
        + "</tool_call>"
        for call in calls
    )


def render_qwen3_xml_calls(calls: tuple[ExpectedCall, ...]) -> str:
    return "\n".join(
        f"<tool_call>\n<function={call.name}>\n"
        + "".join(
            f"<parameter={key}>\n{_as_text(value)}\n</parameter>\n"
            for key, value in call.arguments.items()
        )
        + "</function>\n</tool_call>"
        for call in calls
    )


_CALL_RENDERERS = {
    "deepseek_v4": render_dsml_calls,
    "glm47": render_glm47_calls,
    "qwen3_xml": render_qwen3_xml_calls,
}


THINK_STYLES = (
    "prompt_opened",
    "prompt_and_model_opened",
    "model_opened",
    "chat",
    "chat_with_stray_end",
)
"""Who writes the reasoning tags: the prompt ended with `<think>` (the parser is told so); the
prompt did and the model repeats it; only the model writes `<think>`; chat mode (no reasoning);
chat mode where the model still writes a `</think>` first."""
PROMPT_OPENED_STYLES = ("prompt_opened", "prompt_and_model_opened")
REASONING_STYLES = ("prompt_opened", "prompt_and_model_opened", "model_opened")


def render_output(family: str, message: ExpectedMessage, *, think_style: str) -> str:
    """The text a model of `family` generates; chat styles ignore `message.reasoning`."""
    parts = {
        "prompt_opened": [f"{message.reasoning or ''}\n</think>\n\n"],
        "prompt_and_model_opened": [f"<think>\n{message.reasoning or ''}\n</think>\n\n"],
        "model_opened": [f"<think>\n{message.reasoning or ''}\n</think>\n\n"],
        "chat": [],
        "chat_with_stray_end": ["</think>\n\n"],
    }[think_style]
    parts.append(message.content or "")
    if message.calls:
        parts.append("\n\n" + _CALL_RENDERERS[family](message.calls))
    parts.append(END_OF_TURN[family])
    return "".join(parts)


def schema_for(value: Any) -> dict[str, Any]:
    """A JSON schema that types `value` back to itself."""
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if value is None:
        return {"type": "null"}
    if isinstance(value, list):
        return {"type": "array"}
    return {"type": "object"}


def tools_for(calls: tuple[ExpectedCall, ...]) -> list[dict[str, Any]]:
    """The request's `tools` array for these calls (one tool per name, schemas merged)."""
    properties: dict[str, dict[str, Any]] = {}
    for call in calls:
        tool = properties.setdefault(call.name, {})
        tool.update({key: schema_for(value) for key, value in call.arguments.items()})
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"test tool {name}",
                "parameters": {"type": "object", "properties": props},
            },
        }
        for name, props in properties.items()
    ]
