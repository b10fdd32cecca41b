"""Byte-for-byte parity of our DeepSeek-V4 prompts with vLLM's own encoder.

The reference is vLLM's OpenAI server path: `ChatCompletionRequest` validation, chat params,
`parse_chat_messages` and the DeepSeek-V4 tokenizer's `apply_chat_template` (which calls
`vllm.tokenizers.deepseek_v4_encoding.encode_messages`).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

from services.gateway.reasoning_effort import DEFAULT_EFFORT, requested_effort
from services.tokenizer.chat_formats import ChatRenderError, DeepseekV4Renderer
from tests.chat_formats.deepseek_v4_corpus import CONVERSATIONS, TEMPLATE_KWARGS

pytest.importorskip("vllm.tokenizers.deepseek_v4", reason="vllm is not installed")
tokenizers = pytest.importorskip("tokenizers")

from transformers import PreTrainedTokenizerFast  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.renderers.chat_utils import parse_chat_messages  # noqa: E402
from vllm.tokenizers.deepseek_v4 import get_deepseek_v4_tokenizer  # noqa: E402

# parse_chat_messages reads only the multimodal fields of a ModelConfig; a text-only model has none.
_TEXT_ONLY_MODEL_CONFIG = SimpleNamespace(multimodal_config=None, is_multimodal_model=False,
                                          hf_config=SimpleNamespace(), enable_prompt_embeds=False)
# Rendering to a string never reaches the vocabulary, so a one-word tokenizer is enough.
_DSV4_TOKENIZER = get_deepseek_v4_tokenizer(PreTrainedTokenizerFast(
    tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))))


def vllm_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                chat_template_kwargs: dict[str, Any] | None = None, reasoning_effort: str | None = None) -> str:
    """The prompt vLLM's OpenAI server renders for this request."""
    request = ChatCompletionRequest(model="m", messages=copy.deepcopy(messages), tools=copy.deepcopy(tools),
                                    chat_template_kwargs=chat_template_kwargs, reasoning_effort=reasoning_effort)
    kwargs = request.build_chat_params(None, "openai").get_apply_chat_template_kwargs()
    conversation, _, _ = parse_chat_messages(request.messages, _TEXT_ONLY_MODEL_CONFIG, "openai")
    tool_dicts = [tool.model_dump() for tool in request.tools] if request.tools else None
    return _DSV4_TOKENIZER.apply_chat_template(conversation=conversation, messages=request.messages,
                                               tools=tool_dicts, tokenize=False, **kwargs)


CASES = [(conv, kw) for conv in CONVERSATIONS for kw in TEMPLATE_KWARGS]


def test_corpus_is_large_enough() -> None:
    assert len(CONVERSATIONS) >= 20 and len(CASES) >= 30


@pytest.mark.parametrize(("conversation", "kwargs_name"), CASES)
def test_prompt_matches_vllm(conversation: str, kwargs_name: str) -> None:
    messages, tools = CONVERSATIONS[conversation]
    template_kwargs = TEMPLATE_KWARGS[kwargs_name]
    expected = vllm_prompt(messages, tools, chat_template_kwargs=dict(template_kwargs))
    rendered = DeepseekV4Renderer().render(copy.deepcopy(messages), copy.deepcopy(tools), template_kwargs)
    assert rendered == expected


EFFORT_REQUESTS = [
    ({}, None), ({}, "none"), ({}, "minimal"), ({}, "low"), ({}, "medium"), ({}, "high"), ({}, "xhigh"),
    ({}, "max"), ({"thinking": False}, "max"), ({"enable_thinking": False}, "max"), ({"thinking": False}, None),
    ({"reasoning_effort": "low"}, None), ({"reasoning_effort": "low"}, "max"), ({"enable_thinking": True}, "none"),
]


@pytest.mark.parametrize(("chat_template_kwargs", "effort"), EFFORT_REQUESTS)
@pytest.mark.parametrize("conversation", ["multi_turn_reasoning_history", "two_tool_rounds_then_new_question"])
def test_gateway_effort_renders_like_vllm(conversation: str, chat_template_kwargs: dict[str, Any],
                                           effort: str | None) -> None:
    """The gateway's effort decision, rendered by us, equals vLLM's prompt for the raw request."""
    messages, tools = CONVERSATIONS[conversation]
    decision = requested_effort(reasoning_effort=effort, chat_template_kwargs=chat_template_kwargs) or DEFAULT_EFFORT
    rendered = DeepseekV4Renderer().render(copy.deepcopy(messages), copy.deepcopy(tools),
                                           decision.template_kwargs(chat_template_kwargs))
    assert rendered == vllm_prompt(messages, tools, dict(chat_template_kwargs), reasoning_effort=effort)


# Messages without content: vLLM's server renders them as empty text.
CONTENTLESS = {
    "user": [{"role": "system", "content": "Be brief."}, {"role": "user"}],
    "system_and_tool": [{"role": "system"}, {"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c1"}],
}


@pytest.mark.parametrize("shape", CONTENTLESS)
@pytest.mark.parametrize("kwargs_name", ["effort_high", "chat"])
def test_messages_without_content_render_like_vllm(shape: str, kwargs_name: str) -> None:
    template_kwargs = TEMPLATE_KWARGS[kwargs_name]
    expected = vllm_prompt(CONTENTLESS[shape], None, chat_template_kwargs=dict(template_kwargs))
    assert DeepseekV4Renderer().render(copy.deepcopy(CONTENTLESS[shape]), None, template_kwargs) == expected


@pytest.mark.parametrize("message", [{"role": "function", "name": "now", "content": "12:00"},
                                     {"role": "narrator", "content": "Night falls."}])
def test_roles_the_encoding_has_not_are_refused_as_by_vllm(message: dict[str, Any]) -> None:
    """vLLM's server serves these roles to jinja templates; its DeepSeek-V4 encoder refuses them."""
    messages = [{"role": "user", "content": "What time is it?"}, message]
    with pytest.raises(ValueError, match="Invalid role"):
        vllm_prompt(messages, None)
    with pytest.raises(ChatRenderError) as caught:
        DeepseekV4Renderer().render(copy.deepcopy(messages), None, {})
    assert caught.value.field == "messages[1].role"
