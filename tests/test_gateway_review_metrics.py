"""The gateway's request-latency histogram, scraped from a real mesh's /metrics: what it counts
and whether its buckets can tell long requests apart, as vLLM's `e2e_request_latency_seconds`."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import GatewayMetrics
from tests.cluster.processes import metric, scrape
from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
E2E_COUNT = "backport:e2e_request_latency_seconds_count"


def metrics_url(mesh: RunningMesh) -> str:
    return mesh.base_url.removesuffix("/v1") + "/metrics"


def test_requests_refused_before_any_generation_are_not_request_latencies(
        mesh: RunningMesh) -> None:
    """A 400 or 404 answered in a millisecond is no request's latency: counted there, a burst of
    bad requests pulls the latency quantiles an operator alerts on down to nothing. Such
    requests are counted by status in `gateway_requests_total`."""
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
    before = scrape(metrics_url(mesh))
    with httpx.Client(timeout=60) as http:
        assert http.post(f"{mesh.base_url}/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": -1}).status_code == 400
        assert http.post(f"{mesh.base_url}/completions", json={
            "model": "no-such-model", "prompt": "hi"}).status_code == 404
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    after = scrape(metrics_url(mesh))
    grown = {status: metric(after, "backport:gateway_requests_total", status=status)
             - metric(before, "backport:gateway_requests_total", status=status)
             for status in ("200", "400", "404")}
    assert grown == {"200": 1, "400": 1, "404": 1}
    assert metric(after, E2E_COUNT) - metric(before, E2E_COUNT) == 1


def test_request_latencies_of_minutes_land_in_different_buckets() -> None:
    """A reasoning model's answers take minutes; with the last finite bucket at 80 s every one
    of them fell in +Inf, and each quantile over them read 80 s. vLLM's own buckets for this
    histogram reach two hours."""
    metrics = GatewayMetrics()
    for latency_s in (90.0, 300.0, 1500.0):
        metrics.e2e_latency.observe(latency_s)
    [family] = [f for f in text_string_to_metric_families(metrics.render([]).decode())
                if f.name == "backport:e2e_request_latency_seconds"]
    counts = [(float(s.labels["le"]), s.value) for s in family.samples
              if s.name.endswith("_bucket")]
    # Each latency is first counted in its own bucket: the cumulative counts step 1, 2, 3.
    steps = sorted({count for _, count in counts})
    assert steps[-3:] == [1.0, 2.0, 3.0]
    assert next(le for le, count in counts if count == 3.0) < float("inf")


def test_a_gateway_that_reads_no_registry_exports_no_registry_gauge(mesh: RunningMesh) -> None:
    """This mesh's gateway has its engines by address and no Redis: a
    `backport:registry_reachable` of 0 there would page an operator for an outage of a registry
    that does not exist."""
    samples = scrape(metrics_url(mesh))
    assert "backport:gateway_requests_in_flight" in samples
    assert "backport:registry_reachable" not in samples
