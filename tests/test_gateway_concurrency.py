"""Cancellation and accounting under load through the mesh: what a client that leaves leaves
behind, and what the metrics count meanwhile. Official openai client, real `backport up`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.cluster.processes import metric, scrape
from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
# Long enough that an abandoned request still runs seconds after its client left (the
# embedded model makes 20-100 tokens a second here), short enough to end by teardown.
ABANDONED_MAX_TOKENS = 1500
# Room for a loaded CI host; the abandoned requests would run for 15 s and more.
ABORT_DEADLINE_S = 5.0
LONG_STORY = {"type": "object", "additionalProperties": False, "required": ["story"],
              "properties": {"story": {"type": "string", "minLength": 4000}}}


@dataclass
class MeteredMesh:
    mesh: RunningMesh
    engine_metrics_url: str

    @property
    def gateway_metrics_url(self) -> str:
        return self.mesh.base_url.removesuffix("/v1") + "/metrics"

    def engine_running(self) -> float:
        samples = scrape(self.engine_metrics_url)
        return metric(samples, "vllm:num_requests_running") + metric(samples, "vllm:num_requests_waiting")


@pytest.fixture(scope="module")
def metered(mesh: RunningMesh) -> MeteredMesh:
    # The shared mesh: every count here is read before and after, or is in flight.
    assert mesh.engine_metrics_url is not None
    return MeteredMesh(mesh, mesh.engine_metrics_url)


def client(mesh: RunningMesh, timeout_s: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=timeout_s)


def wait_until_idle(metered: MeteredMesh, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while metered.engine_running():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


ABANDONED_CALLS: dict[str, Any] = {
    "chat": lambda c: c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=ABANDONED_MAX_TOKENS, extra_body={"ignore_eos": True}),
    "batched completions": lambda c: c.completions.create(
        model=MODEL, prompt=["Once upon a time", "Long ago"], max_tokens=ABANDONED_MAX_TOKENS,
        extra_body={"ignore_eos": True}),
    # The Responses API has no ignore_eos: a string of at least 4,000 characters keeps the
    # model writing past max_output_tokens (greedy, it ends a plain story in about 50 tokens).
    "responses": lambda c: c.responses.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=ABANDONED_MAX_TOKENS,
        temperature=0, text={"format": {"type": "json_schema", "name": "story", "schema": LONG_STORY}}),
}


@pytest.mark.parametrize("route", list(ABANDONED_CALLS))
def test_a_client_that_times_out_on_a_non_streamed_request_aborts_it(metered: MeteredMesh,
                                                                      route: str) -> None:
    """Nothing streams yet, so only the gateway's watch on the connection can tell the engine;
    the request is counted as 499 (client closed request), not as an answer sent."""
    assert wait_until_idle(metered, 60)
    before = scrape(metered.gateway_metrics_url)
    with pytest.raises(openai.APITimeoutError):
        ABANDONED_CALLS[route](client(metered.mesh, timeout_s=1.5))
    assert wait_until_idle(metered, ABORT_DEADLINE_S), (
        f"the engine still runs the abandoned request {ABORT_DEADLINE_S} s after its client left")
    after = scrape(metered.gateway_metrics_url)
    assert metric(after, "backport:gateway_requests_in_flight") == 0
    assert metric(after, "backport:engine_requests_in_flight") == 0
    grown = {status: metric(after, "backport:gateway_requests_total", status=status)
             - metric(before, "backport:gateway_requests_total", status=status)
             for status in ("200", "499", "500")}
    assert grown == {"200": 0, "499": 1, "500": 0}


def test_the_engine_counts_an_n_choice_call_in_flight_until_its_last_choice_ends(
        metered: MeteredMesh) -> None:
    """Sampled choices end apart: one stops at EOS while the other runs on to max_tokens.
    Which seeds do depends on the host's arithmetic: on an AMD EPYC host no story of the
    first prompt ended within max_tokens, while the question's answers end at varied lengths."""
    assert wait_until_idle(metered, 60)
    mesh_client = client(metered.mesh)
    engine_before = scrape(metered.engine_metrics_url)
    num_calls, in_flight_when_apart = 0, None
    for seed in range(12):
        prompt = ("Once upon a time", "Q: What is 2+2?\nA:")[seed % 2]
        stream = mesh_client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=160,
                                                temperature=1.0, seed=seed, stream=True)
        num_calls += 1
        finished: set[int] = set()
        in_flight_at_first_finish = None
        num_later_chunks = 0
        for chunk in stream:
            for choice in chunk.choices:
                if choice.finish_reason is not None:
                    finished.add(choice.index)
                    if len(finished) == 1:
                        in_flight_at_first_finish = metric(scrape(metered.engine_metrics_url),
                                                           "backport:engine_requests_in_flight")
                elif finished and choice.text:
                    num_later_chunks += 1
        assert finished == {0, 1}
        # Many later chunks: the engine was still generating the other choice when it was
        # scraped, not done with it and its last chunks merely unread.
        if num_later_chunks >= 10:
            in_flight_when_apart = in_flight_at_first_finish
            break
    assert in_flight_when_apart is not None, "no seed made the two choices end apart"
    assert in_flight_when_apart == 1.0
    engine_after = scrape(metered.engine_metrics_url)
    assert metric(engine_after, "backport:engine_requests_in_flight") == 0
    grown = (metric(engine_after, "backport:engine_generate_requests_total", outcome="finished")
             - metric(engine_before, "backport:engine_generate_requests_total", outcome="finished"))
    assert grown == num_calls
