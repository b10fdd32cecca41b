"""Picks the prompt renderer for a model folder from its `config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.tokenizer.chat_formats.deepseek_v4 import DeepseekV4Renderer
from services.tokenizer.chat_formats.jinja_template import ChatTemplateTokenizer, JinjaTemplateRenderer
from services.tokenizer.chat_formats.protocol import ChatRenderer

# The architectures vLLM serves with DeepSeek-V4's encoding instead of a template.
DEEPSEEK_V4_ARCHITECTURES = frozenset({"DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration"})


def chat_format_name(model_path: str | Path) -> str:
    """`deepseek_v4` for DeepSeek-V4 checkpoints, else `jinja` (the checkpoint's template)."""
    config = read_model_config(model_path)
    architectures = config.get("architectures") or []
    if config.get("model_type") == "deepseek_v4" or DEEPSEEK_V4_ARCHITECTURES.intersection(architectures):
        return "deepseek_v4"
    return "jinja"


def chat_renderer_for(model_path: str | Path, tokenizer: ChatTemplateTokenizer) -> ChatRenderer:
    """The renderer for the model in `model_path`; `tokenizer` is its loaded HF tokenizer."""
    if chat_format_name(model_path) == "deepseek_v4":
        return DeepseekV4Renderer()
    return JinjaTemplateRenderer(tokenizer)


def read_model_config(model_path: str | Path) -> dict[str, Any]:
    """The folder's `config.json`; empty for a GGUF-only folder, which has none (its template
    lives in the tokenizer)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config
