"""`--vllm-args`: vLLM's engine arguments the engine service has no flag for (chunked-prefill
budgets, expert parallelism, speculative decoding...), read as vLLM's real `AsyncEngineArgs`;
a name vLLM would not take is refused before any model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.settings import EngineSettings
from services.engine.vllm_engine import vllm_engine_args
from services.mesh.errors import ServiceStartError
from tests.conftest import REPO_ROOT, engine_environment, free_port


def test_the_arguments_reach_vllm_beside_the_service_s_own(embedded_model_path: Path) -> None:
    settings = EngineSettings(model=str(embedded_model_path), max_model_len=1024,
                              vllm_args='{"max_num_batched_tokens": 1024, "seed": 7, '
                                        '"enable_chunked_prefill": false}')
    args = vllm_engine_args(settings)
    assert (args.max_num_batched_tokens, args.seed, args.enable_chunked_prefill) == (1024, 7, False)
    assert (args.model, args.max_model_len) == (str(embedded_model_path), 1024)


@pytest.mark.parametrize(("vllm_args", "refusal"), [
    ('{"max_num_batched_tokenz": 8}', "'max_num_batched_tokenz' is not one of vLLM's engine arguments"),
    ('{"max_model_len": 8}', "'max_model_len' has its own flag, --max-model-len"),
    ('{"kv_cache_memory_bytes": 8}', "'kv_cache_memory_bytes' is set by the engine service"),
])
def test_a_name_vllm_would_not_take_from_here_is_refused(embedded_model_path: Path, vllm_args: str,
                                                         refusal: str) -> None:
    with pytest.raises(ServiceStartError, match=refusal):
        vllm_engine_args(EngineSettings(model=str(embedded_model_path), vllm_args=vllm_args))


def test_the_reasoning_parser_reaches_vllm_s_structured_outputs(embedded_model_path: Path) -> None:
    """vLLM's structured outputs find the reasoning's end with it; a name vLLM does not know
    is refused here, not in the engine core after the model load."""
    args = vllm_engine_args(EngineSettings(model=str(embedded_model_path), reasoning_parser="qwen3"))
    assert args.create_engine_config().structured_outputs_config.reasoning_parser == "qwen3"
    with pytest.raises(ServiceStartError, match="--reasoning-parser: 'qwen9' is not one of vLLM's"):
        vllm_engine_args(EngineSettings(model=str(embedded_model_path), reasoning_parser="qwen9"))


def test_the_engine_stops_on_a_bad_name_before_loading_its_model(embedded_model_path: Path) -> None:
    engine = subprocess.run(
        [sys.executable, "-m", "services.cli", "engine", "--model", str(embedded_model_path),
         "--port", str(free_port()), "--vllm-args", '{"speculative_confg": {}}'],
        cwd=REPO_ROOT, env=engine_environment() | {"BACKPORT_LOG_LEVEL": "INFO"},
        capture_output=True, text=True, timeout=120)
    assert engine.returncode == 1, engine.stderr[-3000:]
    assert "--vllm-args: 'speculative_confg' is not one of vLLM's engine arguments" in engine.stderr
    assert "Traceback" not in engine.stderr and "load model" not in engine.stderr.lower()


@pytest.mark.parametrize(("value", "problem"), [
    ('{"seed": 7', "BACKPORT_ENGINE_VLLM_ARGS='{\"seed\": 7': Invalid JSON"),
    ("[8192]", "BACKPORT_ENGINE_VLLM_ARGS=[8192]: Input should be a valid dictionary"),
])
def test_a_value_that_is_not_a_json_object_is_refused_naming_the_variable(value: str,
                                                                           problem: str) -> None:
    engine = subprocess.run(
        [sys.executable, "-m", "services.cli", "engine", "--model", "unused"],
        cwd=REPO_ROOT, env=engine_environment() | {"BACKPORT_ENGINE_VLLM_ARGS": value},
        capture_output=True, text=True, timeout=120)
    assert engine.returncode == 2, engine.stderr[-3000:]
    assert problem in engine.stderr
