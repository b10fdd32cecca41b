"""Where the output starts (reasoning or content) is read from the rendered prompt, not from the
request's thinking flags.

GLM-5.3's template has no thinking switch: its generation prompt always ends with `<think>`, so
the model's first words are reasoning even when a client sends `enable_thinking: false` (vLLM's
GLM parser ignores the flag for this template). The mesh here serves the embedded model with a
template of GLM-5.3's shape and a scripted output, through the real engine and parsers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.gateway.parsing.reasoning_formats import GLM45_REASONING, QWEN3_REASONING
from services.gateway.routes.chat import output_starts_in_reasoning
from tests.conftest import RunningMesh, start_mesh, stop_mesh

MODEL = "glm53-shaped"
REASONING = "The user greets me."
CONTENT = "Hello!"
GREETING = [{"role": "user", "content": "Hi there"}]
# GLM-5.3's shape: an effort header instead of an `enable_thinking` switch, `<think>` always opened.
GLM53_SHAPED_TEMPLATE = (
    "[gMASK]<sop>{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}<|system|>{{ message.content }}"
    "{%- elif message.role == 'user' -%}<|user|>{{ message.content }}"
    "{%- elif message.role == 'assistant' -%}<|assistant|></think>{{ message.content or '' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|system|>Reasoning Effort: {{ reasoning_effort | default('high') }}"
    "<|assistant|><think>{%- endif -%}")


@pytest.mark.parametrize(("prompt", "continues", "expected"), [
    ("<|user|>Hi<|assistant|><think>", False, True),  # GLM-5.3, thinking flag or not
    ("<|user|>Hi<|assistant|></think>", False, False),  # GLM-4.x with enable_thinking false
    ("<|im_start|>assistant\n<think>\n", False, True),  # Qwen3 leaving the block open
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False, False),  # Qwen3, thinking off
    ("<|im_start|>assistant\n", False, False),  # the model opens the block itself, if it will
    ("<|user|>What does <think> do?<|assistant|>", False, False),
    ("<|assistant|><think>Let me", True, True),  # a continued message still inside its block
    ("<|assistant|><think>Done.</think>The answer", True, False),
])
def test_the_prompt_says_whether_the_output_starts_in_reasoning(prompt: str, continues: bool,
                                                                expected: bool) -> None:
    for reasoning in (GLM45_REASONING, QWEN3_REASONING):
        assert output_starts_in_reasoning(prompt, reasoning, continues_final_message=continues) is expected


@pytest.fixture(scope="module")
def glm53_shaped_model(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's files with a GLM-5.3-shaped chat template and a scripted answer."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("glm53-shaped")
    for source in embedded_model_path.iterdir():
        if source.name != "chat_template.jinja":
            (folder / source.name).symlink_to(source)
    (folder / "chat_template.jinja").write_text(GLM53_SHAPED_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = f"{REASONING}</think>{CONTENT}"
    script = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(script) == text
    (folder / "scripted_output.json").write_text(json.dumps(script + [tokenizer.eos_token_id]))
    return folder


@pytest.fixture(scope="module")
def client(glm53_shaped_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from tests.e2e.scripted_output import SCRIPT_ENV

    mesh: RunningMesh = start_mesh(
        tmp_path_factory.mktemp("mesh"), "--model", str(glm53_shaped_model),
        "--served-model-name", MODEL, "--max-model-len", "1024", "--reasoning-parser", "glm45",
        "--tool-call-parser", "glm47",
        environment={SCRIPT_ENV: str(glm53_shaped_model / "scripted_output.json"),
                     "BACKPORT_ENGINE_LOGITS_PROCESSORS": json.dumps(
                         ["tests.e2e.scripted_output:ScriptedOutputLogitsProcessor"])})
    try:
        yield openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)
    finally:
        stop_mesh(mesh)


@pytest.mark.parametrize("thinking_off", [
    {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    {"reasoning_effort": "none"},
    {},
])
def test_a_template_that_always_opens_the_reasoning_keeps_it_out_of_the_content(
        client: openai.OpenAI, thinking_off: dict[str, Any]) -> None:
    """vLLM answers ("The user greets me.", "Hello!") for reasoning and content, whatever the flag."""
    reply = client.chat.completions.create(model=MODEL, messages=GREETING, temperature=0,
                                           max_tokens=64, **thinking_off)
    message = reply.choices[0].message
    assert (message.model_extra.get("reasoning_content"), message.content) == (REASONING, CONTENT)
    stream = client.chat.completions.create(model=MODEL, messages=GREETING, temperature=0,
                                            max_tokens=64, stream=True, **thinking_off)
    reasoning, content = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
    assert ("".join(reasoning), "".join(content)) == (REASONING, CONTENT)
