"""The engines this gateway may route to: membership, health probes, circuit breakers, loads."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine.client import EngineClient
from services.engine.registry import EngineRecord
from services.gateway.circuit_breaker import CircuitBreaker
from services.gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
# Slow answers (a busy host) count only when they repeat; a refusal or NOT_SERVING counts at once.
MAX_SLOW_PROBES = 3


@dataclass(eq=False, slots=True)
class EngineState:
    address: str
    client: EngineClient
    breaker: CircuitBreaker
    is_static: bool
    num_in_flight: int = 0
    is_serving: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    ttl_s: float = 0.0
    num_slow_probes: int = 0

    @property
    def is_routable(self) -> bool:
        return self.is_serving and not self.breaker.is_open

    @property
    def state_name(self) -> str:
        if self.breaker.is_open:
            return "ejected"
        return "serving" if self.is_serving else "not_serving"


class EnginePool:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.engines: dict[str, EngineState] = {}
        # Removed engines whose channels still carry streams; closed when those end.
        self._retired: list[EngineState] = []
        self.model_name: str | None = None

    def add(self, address: str, *, is_static: bool) -> EngineState:
        engine = self.engines.get(address)
        if engine is None:
            engine = EngineState(address, EngineClient(address), CircuitBreaker(
                self.settings.breaker_failures, self.settings.breaker_open_s), is_static)
            self.engines[address] = engine
            logger.info("engine %s joined (%s)", address, "static" if is_static else "registry")
        return engine

    def routable(self) -> list[EngineState]:
        return [e for e in self.engines.values() if e.is_routable]

    def acquire(self, engine: EngineState) -> None:
        engine.num_in_flight += 1

    def release(self, engine: EngineState) -> None:
        engine.num_in_flight -= 1

    def sync_registry(self, records: list[EngineRecord], now: float | None = None) -> None:
        """Adds registered engines of the model; an engine leaves once its record has been gone
        a whole TTL, so a Redis restart (records briefly missing) moves nothing, and at once
        when its record names another model."""
        now = time.monotonic() if now is None else now
        # Admitted before the gateway knew its model, or restarted with another one.
        other_model: set[str] = set()
        for record in records:
            if self.model_name is not None and record.model != self.model_name:
                other_model.add(record.address)
                continue
            engine = self.add(record.address, is_static=False)
            engine.last_seen, engine.ttl_s = now, record.ttl_s
        for engine in list(self.engines.values()):
            if not engine.is_static and (engine.address in other_model
                                         or now - engine.last_seen > engine.ttl_s):
                logger.info("engine %s left the registry", engine.address)
                del self.engines[engine.address]
                self._retired.append(engine)
        self._close_idle_retired()

    def restart_absence_clocks(self, now: float | None = None) -> None:
        """The registry was unreachable until now, so nothing was seen missing: a Redis that
        restarted empty gets a whole TTL from now for the engines to write their records
        again. Counting from before the outage dropped serving engines for a moment."""
        now = time.monotonic() if now is None else now
        for engine in self.engines.values():
            if not engine.is_static:
                engine.last_seen = now

    def _close_idle_retired(self) -> None:
        for engine in [e for e in self._retired if e.num_in_flight == 0]:
            self._retired.remove(engine)
            asyncio.get_running_loop().create_task(engine.client.close())

    async def probe_health(self) -> None:
        """One round of health checks; a breaker past its open time is probed back."""
        engines = list(self.engines.values())
        # An engine that leaves the pool during the round has its channel closed under its
        # probe, which then raises; that must not end the round, nor the health-check task.
        answers = await asyncio.gather(*(_probe(e) for e in engines), return_exceptions=True)
        for engine, answer in zip(engines, answers):
            if self.engines.get(engine.address) is not engine:
                continue
            serving = False if isinstance(answer, BaseException) else answer
            if serving is None:  # no answer in time
                engine.num_slow_probes += 1
                if engine.num_slow_probes < MAX_SLOW_PROBES:
                    continue
                serving = False
            else:
                engine.num_slow_probes = 0
            if serving != engine.is_serving:
                logger.info("engine %s is %s", engine.address,
                            "serving" if serving else "not serving")
            engine.is_serving = serving
            if engine.breaker.is_due_for_probe():
                engine.breaker.record_probe(serving)
                if not engine.breaker.is_open:
                    logger.info("engine %s is back after its breaker opened", engine.address)

    async def run_health_checks(self) -> None:
        while True:
            await self.probe_health()
            await asyncio.sleep(self.settings.health_interval_s)

    async def close(self) -> None:
        await asyncio.gather(*(e.client.close() for e in [*self.engines.values(), *self._retired]))


async def _probe(engine: EngineState) -> bool | None:
    """True: SERVING; False: refused or not serving; None: no answer in time."""
    stub = health_pb2_grpc.HealthStub(engine.client.channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        return None if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
