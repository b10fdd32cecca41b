"""Renders with the checkpoint's own jinja chat template (GLM-5.3, Qwen3.8, SmolLM2, ...).

Messages reach the template the way vLLM hands them over, so prompts match a vLLM deployment:
content as one string (parts joined by a newline) or, for templates that loop over content, as
a list of text parts; tool results always as a string; tool-call arguments as objects; the
reasoning under both `reasoning` and `reasoning_content`; developer messages turned into system
messages (merged into one leading system message) when the template does not know the role.
Every template kwarg, such as `enable_thinking`, is passed through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jinja2

from services.tokenizer.chat_formats.jinja_content_format import ContentFormat, content_format
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

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict[str, Any]] | None = None) -> str: ...

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
        tool_dicts = parse_tools(tools) or None
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
        if reserved:
            raise ChatRenderError(f"chat_template_kwargs.{reserved[0]}", "is reserved and cannot be set")
        if add_generation_prompt and continue_final_message:
            raise ChatRenderError("continue_final_message", "cannot be combined with add_generation_prompt")
        # The final message is continued whatever its role, as vLLM's server does (a user turn
        # left open for the model to finish, say); transformers refuses one the template drops.
        template = self._tokenizer.get_chat_template(None, tools=tool_dicts)
        shape = content_format(template)
        conversation = [_template_message(message, shape) for message in parsed]
        if any(message.role == "developer" for message in parsed) and not _knows_developer_role(template):
            conversation = _with_developer_as_system(conversation)
        try:
            prompt = self._tokenizer.apply_chat_template(
                conversation,
                tools=tool_dicts,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                return_dict=False,
                **template_kwargs,
            )
        except jinja2.TemplateError as error:
            raise ChatRenderError("messages", f"the model's chat template rejected the request: {error}") from error
        except (TypeError, ValueError, LookupError, ArithmeticError) as error:
            # A template works on the request's values with Python's operators: a kwarg or
            # message field of a type it did not expect fails there, not in jinja (vLLM's
            # server answers these with 400 too).
            raise ChatRenderError("messages", f"the model's chat template failed on the request: "
                                              f"{type(error).__name__}: {error}") from error
        if not isinstance(prompt, str):
            raise TypeError(f"apply_chat_template returned {type(prompt).__name__}, expected str")
        return prompt


def _template_message(message: ChatMessage, shape: ContentFormat) -> dict[str, Any]:
    content: str | list[dict[str, str]]
    if shape == "openai" and message.role != "tool":
        content = [{"type": "text", "text": text} for text in message.text_parts]
    else:
        content = "\n".join(message.text_parts)
    rendered: dict[str, Any] = {"role": message.role, "content": content}
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


def _knows_developer_role(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _with_developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Templates that do not know the role would drop or reject it; many also insist on a
    # single system message in front, so every system text is merged there.
    converted = [{**message, "role": "system"} if message["role"] == "developer" else message
                 for message in conversation]
    system_indexes = [i for i, message in enumerate(converted) if message["role"] == "system"]
    if system_indexes in ([], [0]):
        return converted
    texts = [_as_text(converted[i]["content"]) for i in system_indexes]
    merged = {"role": "system", "content": "\n\n".join(text for text in texts if text)}
    return [merged, *(message for message in converted if message["role"] != "system")]


def _as_text(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)
