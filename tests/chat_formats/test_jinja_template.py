"""Jinja-template rendering through a real `transformers` tokenizer, and renderer selection."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.tokenizer.chat_formats import (
    ChatRenderError,
    DeepseekV4Renderer,
    JinjaTemplateRenderer,
    chat_format_name,
    chat_renderer_for,
)

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

# Reads what GLM/Qwen templates read: enable_thinking, tools, tool-call arguments as objects,
# reasoning_content, and refuses a conversation that does not start right.
TEMPLATE = (
    "{%- if messages[0].role == 'assistant' %}{{ raise_exception('conversation must not start with assistant') }}"
    "{%- endif %}"
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}[{{ tc.function.name }}:{{ tc.function.arguments | tojson }}]{% endfor %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{{ persona | default('') }}{% endif %}"
)


def _tokenizer(chat_template: str | None) -> Any:
    model = tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")
    loaded = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model))
    loaded.chat_template = chat_template
    return loaded


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return _tokenizer(TEMPLATE)


def test_template_kwargs_reach_the_template(tokenizer: Any) -> None:
    renderer = JinjaTemplateRenderer(tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    assert renderer.render(messages, None, {"enable_thinking": False, "persona": "P"}) == \
        "<user>hi<assistant><think></think>P"
    assert renderer.render(messages, None, {"enable_thinking": True}) == "<user>hi<assistant>"
    assert renderer.render(messages, None, {}, add_generation_prompt=False) == "<user>hi"


def test_messages_reach_the_template_as_vllm_hands_them_over(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning_content": "r",
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    prompt = JinjaTemplateRenderer(tokenizer).render(messages, tools, {})
    assert prompt == '<tools>f;</tools><user>a\nb<assistant><think>r</think>[f:{"x": 1}]<tool>ok<assistant>'


def test_template_errors_and_reserved_kwargs_are_client_errors(tokenizer: Any) -> None:
    renderer = JinjaTemplateRenderer(tokenizer)
    with pytest.raises(ChatRenderError, match="must not start with assistant"):
        renderer.render([{"role": "assistant", "content": "x"}], None, {})
    with pytest.raises(ChatRenderError) as caught:
        renderer.render([{"role": "user", "content": "x"}], None, {"tokenize": True})
    assert caught.value.field == "chat_template_kwargs.tokenize"
    with pytest.raises(ChatRenderError) as caught:
        renderer.render([{"content": "no role"}], None, {})
    assert caught.value.field == "messages[0].role"


def _model_folder(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(("config", "expected"), [
    ({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}, "deepseek_v4"),
    ({"model_type": "deepseek_v4"}, "deepseek_v4"),
    ({"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next"}, "jinja"),
    ({"architectures": ["Qwen4ExpForCausalLM"], "model_type": "qwen4_exp"}, "jinja"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "jinja"),
])
def test_renderer_selection_follows_the_config(tmp_path: Path, tokenizer: Any, config: dict[str, Any],
                                               expected: str) -> None:
    folder = _model_folder(tmp_path, config)
    assert chat_format_name(folder) == expected
    renderer = chat_renderer_for(str(folder), tokenizer)
    assert renderer.name == expected
    assert isinstance(renderer, DeepseekV4Renderer if expected == "deepseek_v4" else JinjaTemplateRenderer)


def test_a_model_without_template_or_config_cannot_serve_chat(tmp_path: Path) -> None:
    assert chat_format_name(tmp_path) == "jinja"
    with pytest.raises(ValueError, match="no chat template"):
        chat_renderer_for(tmp_path, _tokenizer(None))
