"""The gateway's Prometheus metrics, in vLLM's naming style (`backport:*`), in one registry."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

# vLLM's buckets for the histograms of the same names, so that the gateway's and the engines'
# compare bucket by bucket. A request runs for minutes where a reasoning model thinks at length;
# the first token may wait that long behind a queue.
TIME_TO_FIRST_TOKEN_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                             50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                       0.5, 0.75, 1.0, 2.5, 5.0)
ENGINE_STATES = ("serving", "not_serving", "ejected")
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineView(Protocol):
    address: str
    num_in_flight: int

    @property
    def state_name(self) -> str: ...


class GatewayMetrics:
    def __init__(self, *, watches_registry: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("backport:gateway_requests", "HTTP API requests by status code",
                                ["status"], registry=r)
        self.requests_in_flight = Gauge("backport:gateway_requests_in_flight",
                                        "HTTP API requests being served", registry=r)
        self.e2e_latency = Histogram("backport:e2e_request_latency_seconds",
                                     "Request start to last byte, of requests answered or left "
                                     "by their client", buckets=REQUEST_LATENCY_BUCKETS_S,
                                     registry=r)
        self.time_to_first_token = Histogram(
            "backport:time_to_first_token_seconds", "Request start to the first generated token",
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram(
            "backport:inter_token_latency_seconds", "Gap between successive engine chunks, per token",
            buckets=TOKEN_GAP_BUCKETS_S, registry=r)
        self.retries = Counter("backport:engine_retries", "Engine calls retried on another engine "
                                                          "before the first token", registry=r)
        self.stream_failures = Counter("backport:engine_stream_failures", "Streams that lost their "
                                       "engine after the first token", registry=r)
        self.routed = Counter("backport:engine_routed_requests", "Requests sent to each engine",
                              ["engine"], registry=r)
        self.engine_in_flight = Gauge("backport:engine_requests_in_flight",
                                      "This gateway's open calls per engine", ["engine"], registry=r)
        self.engine_state = Gauge("backport:engine_state", "1 for the engine's current state",
                                  ["engine", "state"], registry=r)
        # Exported only by a gateway that reads a registry: a 0 where none is configured
        # would read as a Redis outage.
        self.registry_reachable = Gauge("backport:registry_reachable",
                                        "1 while the Redis engine registry answers",
                                        registry=r if watches_registry else None)

    def render(self, engines: Iterable[EngineView]) -> bytes:
        self.engine_in_flight.clear()
        self.engine_state.clear()
        for engine in engines:
            self.engine_in_flight.labels(engine.address).set(engine.num_in_flight)
            for state in ENGINE_STATES:
                self.engine_state.labels(engine.address, state).set(
                    1 if engine.state_name == state else 0)
        return generate_latest(self.registry)
