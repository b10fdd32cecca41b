"""What the engine service changes of vLLM's defaults on the CPU: the dtype where bf16 is
emulated, the OpenMP thread binding on two cores, where vLLM's one worker runs and how its
engine core starts. The engines of the other tests run with all four."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.engine.llvmlite_in_forked_core import give_llvmlites_library_an_empty_namespace
from services.engine.settings import EngineSettings
from services.engine.vllm_engine import (MULTIPROC_METHOD_ENV, MULTIPROCESSING_ENV,
                                         THREADS_BIND_ENV, cpu_worker_in_engine_core,
                                         engine_dtype, fork_an_engine_core_that_holds_its_worker,
                                         unbind_cpu_threads_on_two_cores)


def checkpoint(tmp_path: Path, **config: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(tmp_path)


@pytest.fixture
def cpu_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands in for an AVX2-only CPU (the CI machines'), where this one may have AVX512-BF16."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)


def test_auto_is_float32_for_a_plain_checkpoint_on_a_cpu_said_to_lack_bf16(
        tmp_path: Path, cpu_without_bf16: None) -> None:
    assert engine_dtype(EngineSettings(model=checkpoint(tmp_path))) == "float32"


@pytest.mark.parametrize(("dtype", "config", "want"), [
    ("bfloat16", {}, "bfloat16"),  # the operator's choice
    ("auto", {"quantization_config": {"quant_method": "awq"}}, "auto"),  # its kernels' dtype
    ("auto", {"model_type": "deepseek_v4"}, "auto"),  # its CPU mixing asserts bf16
])
def test_an_explicit_dtype_a_quantized_checkpoint_and_the_seeds_families_keep_vllms_choice(
        tmp_path: Path, cpu_without_bf16: None, dtype: str, config: dict, want: str) -> None:
    assert engine_dtype(EngineSettings(model=checkpoint(tmp_path, **config), dtype=dtype)) == want


def test_a_model_without_a_local_config_is_left_to_vllm(cpu_without_bf16: None) -> None:
    assert engine_dtype(EngineSettings(model="HuggingFaceTB/SmolLM2-135M-Instruct")) == "auto"


def test_a_cpu_with_bf16_keeps_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert engine_dtype(EngineSettings(model=checkpoint(tmp_path))) == "auto"


@pytest.mark.parametrize(("environ", "tensor_parallel_size", "want"), [
    ({THREADS_BIND_ENV: "nobind"}, 1, "0"),
    ({THREADS_BIND_ENV: "auto"}, 1, None),  # the worker binds its threads in its own process
    ({}, 1, None),  # vLLM's default binding is "auto"
    ({THREADS_BIND_ENV: "nobind"}, 2, None),  # workers of their own
    ({THREADS_BIND_ENV: "nobind", MULTIPROCESSING_ENV: "1"}, 1, "1"),  # the operator's
])
def test_the_worker_joins_the_engine_core_only_with_binding_off_and_one_worker(
        tmp_path: Path, environ: dict[str, str], tensor_parallel_size: int,
        want: str | None) -> None:
    settings = EngineSettings(model=checkpoint(tmp_path), tensor_parallel_size=tensor_parallel_size)
    cpu_worker_in_engine_core(settings, environ)
    assert environ.get(MULTIPROCESSING_ENV) == want


@pytest.mark.parametrize(("environ", "usable_cpus", "tensor_parallel_size", "want"), [
    ({}, 2, 1, "nobind"),  # "auto" would bind one thread and keep the other core
    ({}, 1, 1, "nobind"),
    ({}, 3, 1, None),  # not measured: vLLM's binding stays
    ({}, 2, 2, None),  # a worker a rank, each bound by vLLM
    ({THREADS_BIND_ENV: "auto"}, 2, 1, "auto"),  # the operator's
])
def test_threads_run_unbound_on_two_cores_unless_the_operator_chose(
        tmp_path: Path, environ: dict[str, str], usable_cpus: int, tensor_parallel_size: int,
        want: str | None) -> None:
    settings = EngineSettings(model=checkpoint(tmp_path), tensor_parallel_size=tensor_parallel_size)
    unbind_cpu_threads_on_two_cores(settings, environ, usable_cpus)
    assert environ.get(THREADS_BIND_ENV) == want


WORKER_IN_ENGINE_CORE = {THREADS_BIND_ENV: "nobind", MULTIPROCESSING_ENV: "0"}


@pytest.mark.parametrize(("environ", "method_chosen", "want"), [
    (WORKER_IN_ENGINE_CORE, None, "fork"),
    (WORKER_IN_ENGINE_CORE, "spawn", "spawn"),  # the operator's, or the PLE hook's
    ({THREADS_BIND_ENV: "nobind", MULTIPROCESSING_ENV: "1"}, None, "spawn"),  # a worker process
    ({THREADS_BIND_ENV: "auto", MULTIPROCESSING_ENV: "0"}, None, "spawn"),  # binds in the core
])
def test_the_engine_core_is_forked_only_where_it_holds_an_unbound_worker(
        environ: dict[str, str], method_chosen: str | None, want: str) -> None:
    # As vLLM's CPU platform leaves it once the config is built.
    environ = environ | {MULTIPROC_METHOD_ENV: "spawn"}
    fork_an_engine_core_that_holds_its_worker(method_chosen, environ)
    assert environ[MULTIPROC_METHOD_ENV] == want


def test_llvmlites_library_reads_as_an_empty_namespace_for_vllms_kernel_scan() -> None:
    """A forked engine core with LMCache's connector holds llvmlite, and vLLM's Triton kernel
    scan reads `vars(value).get("kernel")` of every module attribute: `ffi.lib` answered
    `__dict__` with a C function wrapper, which has no `get`."""
    ffi = pytest.importorskip("llvmlite.binding.ffi")
    give_llvmlites_library_an_empty_namespace()
    assert vars(ffi.lib).get("kernel") is None
