"""Messages vLLM's server serves that the gateway answered with a 400: OpenAI's legacy `function`
role, a role only the model's template knows, and messages without content. Through the mesh
they are answered, and their prompt is the tokens vLLM's server renders for them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningMesh

pytest.importorskip("vllm.renderers.hf", reason="vllm is not installed")

from tests.chat_formats.test_jinja_parity import vllm_prompt  # noqa: E402

MODEL = "SmolLM2-135M-Instruct-bf16"
SHAPES: dict[str, list[dict[str, Any]]] = {
    "legacy_function_role": [{"role": "user", "content": "Weather in Paris?"},
                             {"role": "assistant", "content": None},
                             {"role": "function", "name": "get_weather", "content": "Sunny, 24 C"}],
    "role_only_the_template_knows": [{"role": "narrator", "content": "Night falls."},
                                     {"role": "user", "content": "Go on."}],
    "user_message_without_content": [{"role": "system", "content": "Be brief."}, {"role": "user"}],
}


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_message_shape_vllm_serves_is_answered_on_vllms_prompt(
        mesh: RunningMesh, client: openai.OpenAI, embedded_model_path: Path, shape: str) -> None:
    from transformers import AutoTokenizer

    messages = SHAPES[shape]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path)
    expected = tokenizer.encode(vllm_prompt(tokenizer, messages, None, {}), add_special_tokens=False)
    tokenized = httpx.post(mesh.base_url.removesuffix("/v1") + "/tokenize",
                           json={"model": MODEL, "messages": messages}, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == expected
