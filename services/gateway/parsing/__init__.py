"""Reasoning and tool-call parsing of raw model output for the gateway (pure Python).

The gateway makes one `ChatOutputParser` per choice, feeds it each text delta and sends the
returned `MessageDelta`s; `parse_output` does the same for a non-streamed response.
"""

from services.gateway.parsing.messages import (
    AssistantMessage,
    MessageDelta,
    ToolCall,
    ToolCallDelta,
)
from services.gateway.parsing.output_parser import ChatOutputParser, new_call_id, parse_output
from services.gateway.parsing.registry import (
    REASONING_FORMATS,
    TOOL_CALL_FORMATS,
    UnknownParserError,
)

REASONING_PARSER_NAMES = tuple(sorted(REASONING_FORMATS))
TOOL_CALL_PARSER_NAMES = tuple(sorted(TOOL_CALL_FORMATS))

__all__ = [
    "REASONING_PARSER_NAMES",
    "TOOL_CALL_PARSER_NAMES",
    "AssistantMessage",
    "ChatOutputParser",
    "MessageDelta",
    "ToolCall",
    "ToolCallDelta",
    "UnknownParserError",
    "new_call_id",
    "parse_output",
]
