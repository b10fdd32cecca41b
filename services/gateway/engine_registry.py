"""Watches the engine registry in Redis; when Redis is away, the last view stands."""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.engine.registry import REGISTRY_KEY_PREFIX, EngineRecord
from services.gateway.engine_pool import EnginePool
from services.gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)


class RegistryWatcher:
    def __init__(self, redis_url: str, pool: EnginePool, metrics: GatewayMetrics,
                 poll_s: float) -> None:
        self._redis = Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.pool = pool
        self.metrics = metrics
        self.poll_s = poll_s
        self._is_reachable = True
        # Keys already reported as not holding a record: warned once, not every poll.
        self._malformed_keys: set[bytes] = set()

    async def read(self) -> list[EngineRecord]:
        keys = [key async for key in self._redis.scan_iter(match=REGISTRY_KEY_PREFIX + "*")]
        values = await self._redis.mget(keys) if keys else []
        records, malformed_keys = [], set()
        for key, value in zip(keys, values):
            if value is None:  # expired between the scan and the read
                continue
            try:
                records.append(EngineRecord.decode(value))
            except ValueError as error:
                malformed_keys.add(key)
                if key not in self._malformed_keys:
                    logger.warning("ignoring registry key %r, not an engine record: %s", key, error)
        self._malformed_keys = malformed_keys
        return records

    async def refresh(self) -> None:
        try:
            records = await self.read()
        except (RedisError, OSError) as error:
            if self._is_reachable:
                logger.warning("engine registry unreachable, keeping the last view: %s", error)
            self._is_reachable = False
            self.metrics.registry_reachable.set(0)
            return
        if not self._is_reachable:
            logger.info("engine registry reachable again")
            self.pool.restart_absence_clocks()
        self._is_reachable = True
        self.metrics.registry_reachable.set(1)
        self.pool.sync_registry(records)

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        await self._redis.aclose()
