"""Reasoning formats (`deepseek_v4`, `glm45`, `qwen3`): a `<think>...</think>` block.

All three families use the same tags; they differ in who writes `<think>`:
- DeepSeek-V4 ends a thinking-mode prompt with `<think>` and a chat-mode prompt with `</think>`,
  so the output starts inside the reasoning (thinking) or is all content (chat).
- Qwen3 (`enable_thinking`) and GLM-4.5/4.7 sometimes leave `<think>` in the prompt and sometimes
  let the model write it; GLM-5.3 always opens `<think>` in the prompt.
So the parser starts in the reasoning when the prompt ended with `<think>` (`thinking=True`),
and a `<think>` written by the model opens the reasoning in either case, as long as no content
came before it (after content it is the answer's own text, say about these very tags; vLLM's
qwen3 parser keeps it too). A second block after the first (only whitespace between) continues
the reasoning after a blank line, where vLLM runs the two texts together (glm45, deepseek_v4) or
makes the second block content, tag included (qwen3). A `</think>` with no open reasoning (the
model closing a block the prompt opened, or a chat-mode slip) is dropped; a duplicate `<think>`
inside the reasoning is dropped; the wrapper of tool calls (`<tool_call>`, the DSML block)
starting inside the reasoning ends it, while other tool markup there is the reasoning's text,
as in vLLM. The terminators are each family's end-of-turn special tokens.
"""

from __future__ import annotations

from services.gateway.parsing.dsml_tool_calls import END_OF_SENTENCE, USER_TURN
from services.gateway.parsing.formats import ReasoningFormat
from services.gateway.parsing.glm47_tool_calls import GLM47_FORMAT
from services.gateway.parsing.qwen3_xml_tool_calls import QWEN3_XML_FORMAT

THINK_START = "<think>"
THINK_END = "</think>"

DEEPSEEK_V4_REASONING = ReasoningFormat(
    name="deepseek_v4", start=THINK_START, end=THINK_END, terminators=(END_OF_SENTENCE, USER_TURN)
)
GLM45_REASONING = ReasoningFormat(
    name="glm45", start=THINK_START, end=THINK_END, terminators=GLM47_FORMAT.terminators
)
QWEN3_REASONING = ReasoningFormat(
    name="qwen3", start=THINK_START, end=THINK_END, terminators=QWEN3_XML_FORMAT.terminators
)
