"""Parser names, as vLLM spells them for `--tool-call-parser` and `--reasoning-parser`."""

from __future__ import annotations

from types import MappingProxyType

from services.gateway.parsing.dsml_tool_calls import DSML_FORMAT
from services.gateway.parsing.formats import ReasoningFormat, ToolCallFormat
from services.gateway.parsing.glm47_tool_calls import GLM47_FORMAT
from services.gateway.parsing.qwen3_xml_tool_calls import QWEN3_XML_FORMAT
from services.gateway.parsing.reasoning_formats import (
    DEEPSEEK_V4_REASONING,
    GLM45_REASONING,
    QWEN3_REASONING,
)

TOOL_CALL_FORMATS = MappingProxyType(
    {format_.name: format_ for format_ in (DSML_FORMAT, GLM47_FORMAT, QWEN3_XML_FORMAT)}
)
REASONING_FORMATS = MappingProxyType(
    {format_.name: format_ for format_ in (DEEPSEEK_V4_REASONING, GLM45_REASONING, QWEN3_REASONING)}
)


class UnknownParserError(ValueError):
    """A parser name this gateway does not implement."""


def tool_call_format(name: str) -> ToolCallFormat:
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        raise UnknownParserError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_CALL_FORMATS))}"
        ) from None


def reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise UnknownParserError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_FORMATS))}"
        ) from None
