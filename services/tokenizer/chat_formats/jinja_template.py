"""Renders with the checkpoint's own jinja chat template (GLM-5.3, Qwen3.8, SmolLM2, ...).

Messages reach the template the way vLLM hands them over for string-content templates: text
parts joined by a newline, tool-call arguments as objects, the reasoning under both `reasoning`
and `reasoning_content` (templates read one or the other). Every template kwarg, such as
`enable_thinking`, is passed through to the template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jinja2

from services.tokenizer.chat_formats.openai_messages import ChatMessage, parse_messages, parse_tools
from services.tokenizer.chat_formats.protocol import ChatRenderError

# apply_chat_template's own parameters: a template kwarg with one of these names would
# silently change how the call behaves instead of reaching the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatTemplateTokenizer(Protocol):
    """The part of a `transformers` tokenizer this renderer uses."""

    chat_template: str | dict[str, str] | None

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


class JinjaTemplateRenderer:
    """Renders through `tokenizer.apply_chat_template` with the template kwargs passed through."""

    name = "jinja"

    def __init__(self, tokenizer: ChatTemplateTokenizer) -> None:
        if not tokenizer.chat_template:
            raise ValueError("the model's tokenizer has no chat template; it cannot serve chat requests")
        self._tokenizer = tokenizer

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """Renders the prompt; template errors (`raise_exception`) become `ChatRenderError`."""
        parsed = parse_messages(messages)
        tool_dicts = parse_tools(tools)
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
        if reserved:
            raise ChatRenderError(f"chat_template_kwargs.{reserved[0]}", "is reserved and cannot be set")
        if add_generation_prompt and continue_final_message:
            raise ChatRenderError("continue_final_message", "cannot be combined with add_generation_prompt")
        if continue_final_message and parsed[-1].role != "assistant":
            raise ChatRenderError(f"messages[{len(parsed) - 1}].role",
                                  "continue_final_message needs a final assistant message")
        try:
            prompt = self._tokenizer.apply_chat_template(
                [_template_message(message) for message in parsed],
                tools=tool_dicts or None,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                return_dict=False,
                **template_kwargs,
            )
        except jinja2.TemplateError as error:
            raise ChatRenderError("messages", f"the model's chat template rejected the request: {error}") from error
        if not isinstance(prompt, str):
            raise TypeError(f"apply_chat_template returned {type(prompt).__name__}, expected str")
        return prompt


def _template_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": "\n".join(message.text_parts)}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls
        ]
    if message.reasoning is not None:
        rendered["reasoning"] = message.reasoning
        rendered["reasoning_content"] = message.reasoning
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered
