"""The engine registry in Redis: each engine's record under a key that lives one TTL.

An engine writes `backport:engines:<address>` (JSON `EngineRecord`) with an expiry of `ttl_s`
and rewrites it every `ttl_s / 3`, so a Redis that restarts empty is whole again within one
TTL. It deletes the key when it drains. Gateways read the keys; nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pydantic import TypeAdapter
from redis.asyncio import Redis
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

REGISTRY_KEY_PREFIX = "backport:engines:"


@dataclass(frozen=True, slots=True)
class EngineRecord:
    address: str
    model: str
    max_model_len: int
    ttl_s: float
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0

    @property
    def key(self) -> str:
        return REGISTRY_KEY_PREFIX + self.address

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> EngineRecord:
        """ValueError for a value that is not a record (a broken write, another tool's key):
        one such key must not stop a gateway from reading the others. Unknown fields are
        ignored, so records of a newer engine still read."""
        return _RECORD_ADAPTER.validate_json(raw)


_RECORD_ADAPTER = TypeAdapter(EngineRecord)


class EngineRegistration:
    """Keeps one engine's record alive in Redis until `deregister`."""

    def __init__(self, redis_url: str, current_record: Callable[[], EngineRecord]) -> None:
        self._redis = Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._current_record = current_record
        self._heartbeat: asyncio.Task[None] | None = None
        # None until the first write: its success is the registration, its failure a warning.
        self._is_reachable: bool | None = None
        self._is_registered = False

    async def start(self) -> None:
        self._is_registered = True
        await self._write()
        self._heartbeat = asyncio.create_task(self._beat())

    async def _write(self) -> None:
        record = self._current_record()
        try:
            await self._redis.set(record.key, record.encode(), px=int(record.ttl_s * 1000))
            if self._is_reachable is None:
                logger.info("registered %s in the registry at %s", record.address, self._where)
            elif not self._is_reachable:
                logger.info("registry reachable again; %s re-registered", record.address)
            self._is_reachable = True
        except (RedisError, OSError) as error:
            # Redis may restart; the next beat writes the record again.
            if self._is_reachable is not False:
                logger.warning("cannot write the registry at %s: %s", self._where, error)
            self._is_reachable = False

    @property
    def _where(self) -> str:
        """The registry's host, port and database: the URL may hold a password."""
        connection = self._redis.connection_pool.connection_kwargs
        if "path" in connection:
            return f"unix:{connection['path']} db {connection.get('db', 0)}"
        return f"{connection.get('host')}:{connection.get('port')} db {connection.get('db', 0)}"

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._current_record().ttl_s / 3)
            await self._write()

    async def deregister(self) -> None:
        if not self._is_registered:
            return
        self._is_registered = False
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        try:
            await self._redis.delete(self._current_record().key)
        except (RedisError, OSError) as error:
            logger.warning("cannot remove the registry record: %s", error)
        await self._redis.aclose()
