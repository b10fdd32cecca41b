"""The engine's Prometheus endpoint: vLLM's own metrics (`vllm:*`, recorded by the
`PrometheusStatLogger` AsyncLLM always installs) and the service's (`backport:engine_*`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, start_http_server

GENERATE_REQUESTS = Counter(
    "backport:engine_generate_requests", "Generate calls by outcome "
    "(finished, cancelled, invalid, unavailable, failed)", ["outcome"])
REQUESTS_IN_FLIGHT = Gauge("backport:engine_requests_in_flight", "Generate calls open now")
IS_SERVING = Gauge("backport:engine_serving", "1 while the engine accepts requests, 0 while "
                                              "it drains or after its core died")


def serve_metrics(host: str, port: int) -> None:
    """Serves the default registry over HTTP from a daemon thread."""
    start_http_server(port, addr=host)
