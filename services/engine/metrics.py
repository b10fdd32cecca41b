"""The engine's Prometheus endpoint: vLLM's own metrics (`vllm:*`, recorded by the
`PrometheusStatLogger` AsyncLLM always installs) and the service's (`backport:engine_*`).
Both live in prometheus_client's default registry, so one endpoint serves them."""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge, start_http_server

from services.mesh.errors import ServiceStartError


class EngineMetrics:
    """The service's own metrics; create one per process."""

    def __init__(self) -> None:
        self.generate_requests = Counter(
            "backport:engine_generate_requests", "Generate calls by outcome "
            "(finished, cancelled, invalid, unavailable, failed)", ["outcome"])
        self.requests_in_flight = Gauge("backport:engine_requests_in_flight",
                                        "Generate calls open now")
        self.is_serving = Gauge("backport:engine_serving", "1 while the engine accepts requests, "
                                                           "0 while it drains or after its core died")

    def serve(self, host: str, port: int) -> None:
        """Serves the default registry over HTTP from a daemon thread."""
        try:
            server, _ = start_http_server(port, addr=host)
        except OSError as error:
            raise ServiceStartError(f"the engine's metrics endpoint cannot listen on {host}:{port}: "
                                    f"{error.strerror}") from None
        # vLLM's engine core, forked from this process on the CPU, would hold the port past the
        # service's exit: a restart on it would find it taken.
        os.register_at_fork(after_in_child=server.socket.close)
