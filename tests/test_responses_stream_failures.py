"""A Responses stream that fails once begun ends as OpenAI's do: an `error` event, then
`response.failed` with the output so far, and its engine request is aborted.

Real processes: `backport up` on the embedded model, its tokenizer service frozen with SIGSTOP
mid-stream, so that the gateway's next detokenize step passes its deadline (2 s here).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.cluster.processes import child_pid, engine_num_running
from tests.conftest import RunningMesh, start_mesh, stop_mesh

MODEL = "SmolLM2-135M-Instruct-bf16"
TIMEOUT_S = 2
# Past what the engine generates in the test's time: it must stop because it was aborted.
MAX_OUTPUT_TOKENS = 1800


@pytest.fixture(scope="module")
def deadline_mesh(embedded_model_path: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMesh]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BACKPORT_GATEWAY_TOKENIZER_TIMEOUT_S", str(TIMEOUT_S))
        running = start_mesh(tmp_path_factory.mktemp("responses-deadline-mesh"), "--max-model-len", "2048")
    yield running
    stop_mesh(running)


def test_a_stream_failing_mid_way_ends_with_error_then_response_failed(deadline_mesh: RunningMesh) -> None:
    client = openai.OpenAI(base_url=deadline_mesh.base_url, api_key="unused", max_retries=0, timeout=60)
    tokenizer_pid = child_pid(deadline_mesh.process.pid, "services.cli", "tokenizer")
    events = []
    with client.responses.stream(model=MODEL, input="Write a very long story about old GPUs.",
                                 temperature=0, max_output_tokens=MAX_OUTPUT_TOKENS) as stream:
        try:
            for event in stream:
                events.append(event)
                num_deltas = sum(e.type == "response.output_text.delta" for e in events)
                if event.type == "response.output_text.delta" and num_deltas == 2:
                    os.kill(tokenizer_pid, signal.SIGSTOP)
        finally:
            os.kill(tokenizer_pid, signal.SIGCONT)

    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    error, failed = events[-2], events[-1]
    assert error.code == "timeout_error" and "did not answer" in error.message
    assert failed.response.status == "failed" and failed.response.id == events[0].response.id
    assert failed.response.error.code == "server_error" and failed.response.error.message == error.message
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed_text and failed.response.output_text == streamed_text
    deadline = time.monotonic() + 10
    while engine_num_running(deadline_mesh.engine_address) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine_num_running(deadline_mesh.engine_address) == 0
