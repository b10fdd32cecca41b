"""Jinja-template prompts equal vLLM's for the same request, template by template.

The reference is vLLM's HF path: `ChatCompletionRequest`, content-format detection,
`parse_chat_messages` and `safe_apply_chat_template`. The templates cover the shapes real
checkpoints take: content printed as a string, content looped over (Qwen3.5+), content passed to
a macro (GLM-5.x), and a template that knows the developer role.
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest

from services.gateway.reasoning_effort import passthrough_template_kwargs
from services.tokenizer.chat_formats import JinjaTemplateRenderer
from services.tokenizer.chat_formats.jinja_content_format import content_format
from services.tokenizer.chat_formats.protocol import ChatRenderError
from tests.chat_formats.deepseek_v4_corpus import CONVERSATIONS

pytest.importorskip("vllm.renderers.hf", reason="vllm is not installed")
tokenizers = pytest.importorskip("tokenizers")

from transformers import PreTrainedTokenizerFast  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.renderers.chat_utils import parse_chat_messages  # noqa: E402
from vllm.renderers.hf import _detect_content_format, safe_apply_chat_template  # noqa: E402

_COMMON_TAIL = (
    "{%- if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% else %}<think>{% endif %}{{ persona | default('') }}{{ reasoning_effort | default('') }}"
    "{% endif %}"
)
_TOOLS_HEAD = "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
_CALLS = ("{%- for tc in m.tool_calls or [] %}<call id={{ tc.id | tojson }}>{{ tc.function.name }}"
          "{{ tc.function.arguments | tojson }}</call>{% endfor %}"
          "{% if m.reasoning_content %}<r>{{ m.reasoning_content }}</r>{% endif %}")
TEMPLATES = {
    "string": _TOOLS_HEAD + "{%- for m in messages %}<{{ m.role }}>{{ m.content }}" + _CALLS + "{% endfor %}"
              + _COMMON_TAIL,
    "content_loop": _TOOLS_HEAD + "{%- for m in messages %}<{{ m.role }}>{% if m.content is string %}"
                    "{{ m.content }}{% else %}{% for part in m.content %}[{{ part.text }}]{% endfor %}{% endif %}"
                    + _CALLS + "{% endfor %}" + _COMMON_TAIL,
    "content_macro": "{% macro visible_text(c) %}{% if c is string %}{{ c }}{% else %}{% for item in c %}"
                     "{{ item.text }}{% endfor %}{% endif %}{% endmacro %}" + _TOOLS_HEAD
                     + "{%- for m in messages %}<{{ m.role }}>{{ visible_text(m.content) }}" + _CALLS
                     + "{% endfor %}" + _COMMON_TAIL,
    "knows_developer": _TOOLS_HEAD + "{%- for m in messages %}{% if m.role == 'developer' %}<dev>{% else %}"
                       "<{{ m.role }}>{% endif %}{{ m.content }}" + _CALLS + "{% endfor %}" + _COMMON_TAIL,
}
# parse_chat_messages and safe_apply_chat_template read only these ModelConfig fields here.
_TEXT_ONLY_MODEL_CONFIG = SimpleNamespace(multimodal_config=None, is_multimodal_model=False, enable_prompt_embeds=False,
                                          hf_config=SimpleNamespace(model_type="llama"))
KWARGS = {"none": {}, "no_thinking": {"enable_thinking": False}, "custom": {"enable_thinking": True, "persona": "P"}}


@functools.cache
def _tokenizer(chat_template: str) -> Any:
    model = tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")
    loaded = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model))
    loaded.chat_template = chat_template
    return loaded


def vllm_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                chat_template_kwargs: dict[str, Any], reasoning_effort: str | None = None,
                continue_final_message: bool = False) -> str:
    request = ChatCompletionRequest(model="m", messages=copy.deepcopy(messages), tools=copy.deepcopy(tools),
                                    chat_template_kwargs=chat_template_kwargs, reasoning_effort=reasoning_effort,
                                    add_generation_prompt=not continue_final_message,
                                    continue_final_message=continue_final_message)
    kwargs = request.build_chat_params(None, "auto").get_apply_chat_template_kwargs()
    shape = _detect_content_format(tokenizer.chat_template, default="string")
    conversation, _, _ = parse_chat_messages(request.messages, _TEXT_ONLY_MODEL_CONFIG, shape)
    tool_dicts = [tool.model_dump() for tool in request.tools] if request.tools else None
    return safe_apply_chat_template(_TEXT_ONLY_MODEL_CONFIG, tokenizer, conversation, tools=tool_dicts,
                                    chat_template=tokenizer.chat_template, tokenize=False, **kwargs)


@pytest.mark.parametrize("template", TEMPLATES)
def test_content_format_detection_agrees_with_vllm(template: str) -> None:
    assert content_format(TEMPLATES[template]) == _detect_content_format(TEMPLATES[template], default="string")


# Every conversation through every template; the kwargs variants only need one template.
CASES = [(template, conversation, "custom") for template in TEMPLATES for conversation in CONVERSATIONS] + [
    ("string", conversation, kwargs_name) for conversation in CONVERSATIONS for kwargs_name in ("none", "no_thinking")]


@pytest.mark.parametrize(("template", "conversation", "kwargs_name"), CASES)
def test_prompt_matches_vllm(template: str, conversation: str, kwargs_name: str) -> None:
    tokenizer = _tokenizer(TEMPLATES[template])
    messages, tools = CONVERSATIONS[conversation]
    expected = vllm_prompt(tokenizer, messages, tools, dict(KWARGS[kwargs_name]))
    rendered = JinjaTemplateRenderer(tokenizer).render(copy.deepcopy(messages), copy.deepcopy(tools),
                                                       KWARGS[kwargs_name])
    assert rendered == expected


# Requests vLLM's server renders that a stricter reading of OpenAI's schema would refuse.
CLIENT_SHAPES: dict[str, tuple[list[dict[str, Any]], bool]] = {
    "assistant_content_null_empty_tool_calls": ([{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": None, "tool_calls": []},
                                                 {"role": "user", "content": "Hello?"}], False),
    "refusal_part": ([{"role": "user", "content": "Do it"},
                      {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
                      {"role": "user", "content": "Why?"}], False),
    "thinking_part": ([{"role": "user", "content": "Q"},
                       {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"},
                                                         {"type": "text", "text": "A"}]},
                       {"role": "user", "content": "Q again"}], False),
    "continue_final_user_message": ([{"role": "user", "content": "Complete: the capital of France is"}], True),
    # OpenAI's legacy function calling: the result comes back in a `function` message.
    "legacy_function_role": ([{"role": "user", "content": "Weather in Paris?"},
                              {"role": "assistant", "content": None},
                              {"role": "function", "name": "get_weather", "content": "Sunny, 24 C"}], False),
    "role_only_the_template_knows": ([{"role": "narrator", "content": "Night falls."},
                                      {"role": "user", "content": "Go on."}], False),
    "user_message_without_content": ([{"role": "system", "content": "Be brief."}, {"role": "user"}], False),
    "tool_and_system_messages_without_content": ([{"role": "system"}, {"role": "user", "content": "Hi"},
                                                  {"role": "tool", "tool_call_id": "c1"}], False),
}


@pytest.mark.parametrize("template", ["string", "content_loop"])
@pytest.mark.parametrize("shape", CLIENT_SHAPES)
def test_requests_vllm_renders_render_the_same(template: str, shape: str) -> None:
    tokenizer = _tokenizer(TEMPLATES[template])
    messages, continue_final_message = CLIENT_SHAPES[shape]
    expected = vllm_prompt(tokenizer, messages, None, {}, continue_final_message=continue_final_message)
    rendered = JinjaTemplateRenderer(tokenizer).render(copy.deepcopy(messages), None, {},
                                                       add_generation_prompt=not continue_final_message,
                                                       continue_final_message=continue_final_message)
    assert rendered == expected


# Requests vLLM's server refuses (its request schema holds OpenAI's required fields), each with
# the field our error names: a template must not see a tool call the client never named.
REFUSED_SHAPES: dict[str, tuple[list[dict[str, Any]], str]] = {
    "tool_call_without_id": ([{"role": "user", "content": "Weather?"},
                              {"role": "assistant", "content": None, "tool_calls": [
                                  {"type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                              {"role": "user", "content": "And now?"}], "messages[1].tool_calls[0].id"),
    "tool_call_with_null_id": ([{"role": "user", "content": "Weather?"},
                                {"role": "assistant", "content": None, "tool_calls": [
                                    {"id": None, "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                                {"role": "user", "content": "And now?"}], "messages[1].tool_calls[0].id"),
}


@pytest.mark.parametrize("shape", REFUSED_SHAPES)
def test_requests_vllm_refuses_are_refused_naming_the_field(shape: str) -> None:
    tokenizer = _tokenizer(TEMPLATES["string"])
    messages, field = REFUSED_SHAPES[shape]
    with pytest.raises(pydantic.ValidationError):
        vllm_prompt(tokenizer, messages, None, {})
    with pytest.raises(ChatRenderError) as caught:
        JinjaTemplateRenderer(tokenizer).render(copy.deepcopy(messages), None, {})
    assert caught.value.field == field


@pytest.mark.parametrize("effort", [None, "none", "minimal", "medium", "high", "max"])
@pytest.mark.parametrize("chat_template_kwargs", [{}, {"enable_thinking": False}, {"reasoning_effort": "low"}])
def test_gateway_passthrough_effort_renders_like_vllm(chat_template_kwargs: dict[str, Any], effort: str | None) -> None:
    tokenizer = _tokenizer(TEMPLATES["string"])
    messages, tools = CONVERSATIONS["multi_turn_reasoning_history"]
    expected = vllm_prompt(tokenizer, messages, tools, dict(chat_template_kwargs), reasoning_effort=effort)
    template_kwargs = passthrough_template_kwargs(effort, chat_template_kwargs)
    assert JinjaTemplateRenderer(tokenizer).render(copy.deepcopy(messages), tools, template_kwargs) == expected
