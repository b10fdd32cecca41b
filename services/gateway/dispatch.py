"""Sends one engine request to an engine: chosen by the router once the prompt is known,
retried on another engine while no token has been produced."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from backport.v1 import common_pb2
from backport.v1 import engine_pb2 as pb
from services.gateway.engine_pool import EnginePool, EngineState
from services.gateway.errors import ServiceUnavailableError
from services.gateway.metrics import GatewayMetrics
from services.gateway.request_context import current_request_context
from services.gateway.routing import Candidate, Router
from services.gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)

# Failures that say nothing about the request itself: another engine may well serve it.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                             grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
                             grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(slots=True)
class OpenedCall:
    engine: EngineState
    call: grpc.aio.UnaryStreamCall
    first: pb.GenerateResponse | None  # None: the stream ended at once


class EngineRoute:
    """One request's way to an engine; `open` picks, calls and fails over."""

    def __init__(self, pool: EnginePool, router: Router, metrics: GatewayMetrics,
                 settings: GatewaySettings, session_key: str | None) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.settings = settings
        self.session_key = session_key
        self.engine: EngineState | None = None

    @property
    def address(self) -> str:
        return self.engine.address if self.engine is not None else "(none yet)"

    async def open(self, request: pb.GenerateRequest) -> OpenedCall:
        tried: set[str] = set()
        last_failure = "no engine is available"
        for attempt in range(self.settings.max_attempts):
            if attempt:
                # With no engine left the answer is a 503 now, not after the backoff.
                if not self._candidates(tried):
                    break
                await asyncio.sleep(self.settings.retry_backoff_s * 2 ** (attempt - 1))
            # Chosen after the backoff: the pool may have moved on during it (an engine left
            # and had its channel closed, or turned not serving).
            engine = self._choose(request, tried)
            if engine is None:
                break
            if attempt:
                self.metrics.retries.inc()  # only a call that is sent again counts
            tried.add(engine.address)
            self.engine = engine
            opened, failure = await self._try(engine, request)
            if opened is not None:
                engine.breaker.record_success()
                current_request_context().engine_addresses.append(engine.address)
                return opened
            last_failure = f"engine {engine.address}: {failure}"
            engine.breaker.record_failure()
            logger.warning("request %s not started on %s (%s)", request.request_id,
                           engine.address, failure)
        raise ServiceUnavailableError(f"no engine could take the request ({last_failure})")

    def record_stream_failure(self) -> None:
        """The engine failed after the first token: counted, and fed to its breaker."""
        self.metrics.stream_failures.inc()
        if self.engine is not None:
            self.engine.breaker.record_failure()

    def _candidates(self, tried: set[str]) -> list[EngineState]:
        engines = [e for e in self.pool.routable() if e.address not in tried]
        if not engines:
            # Health is sampled; an engine not yet seen failing is still worth one try.
            engines = [e for e in self.pool.engines.values()
                       if e.address not in tried and not e.breaker.is_open]
        return engines

    def _choose(self, request: pb.GenerateRequest, tried: set[str]) -> EngineState | None:
        engines = self._candidates(tried)
        if not engines:
            return None
        by_address = {e.address: e for e in engines}
        chosen = self.router.choose([Candidate(e.address, e.num_in_flight) for e in engines],
                                    request.prompt_token_ids, self.session_key)
        return by_address[chosen.address]

    async def _try(self, engine: EngineState,
                   request: pb.GenerateRequest) -> tuple[OpenedCall | None, str]:
        self.pool.acquire(engine)
        self.metrics.routed.labels(engine.address).inc()
        call = engine.client.generate(request)
        call.add_done_callback(lambda _: self.pool.release(engine))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as error:
            call.cancel()
            if error.code() not in RETRYABLE_CODES:
                raise ServiceUnavailableError(
                    f"engine {engine.address} failed: {error.code().name}") from error
            return None, error.code().name
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            return None, "the stream ended before any response"
        if (first.WhichOneof("response") == "error"
                and first.error.code == common_pb2.ERROR_CODE_UNAVAILABLE):
            call.cancel()
            return None, first.error.message
        return OpenedCall(engine, call, first), ""
