"""Prompt rendering per model: DeepSeek-V4's own encoding, or the checkpoint's jinja template.

The tokenizer service calls `chat_renderer_for(model_path, tokenizer)` once at start-up and
`renderer.render(...)` per request; `ChatRenderError` is the client's fault (HTTP 400).
"""

from services.tokenizer.chat_formats.deepseek_v4 import DeepseekV4Mode, DeepseekV4Renderer
from services.tokenizer.chat_formats.jinja_template import JinjaTemplateRenderer
from services.tokenizer.chat_formats.protocol import ChatRenderer, ChatRenderError
from services.tokenizer.chat_formats.selection import chat_format_name, chat_renderer_for

__all__ = [
    "ChatRenderError",
    "ChatRenderer",
    "DeepseekV4Mode",
    "DeepseekV4Renderer",
    "JinjaTemplateRenderer",
    "chat_format_name",
    "chat_renderer_for",
]
