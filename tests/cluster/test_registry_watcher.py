"""The gateway's view of the engine registry across a Redis restart, against a real
redis-server (no engines: the records are written here, as an engine's heartbeat would)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from services.engine.registry import EngineRecord
from services.gateway.engine_pool import EnginePool
from services.gateway.engine_registry import RegistryWatcher
from services.gateway.metrics import GatewayMetrics
from services.gateway.settings import GatewaySettings
from tests.cluster.processes import RedisServer, redis_server_binary
from tests.conftest import free_port

TTL_S = 1.0

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server")


def _register(server: RedisServer, record: EngineRecord) -> None:
    client = redis.Redis(port=server.port, socket_timeout=1.0)
    client.set(record.key, record.encode(), px=int(record.ttl_s * 1000))


async def _watch_through_a_restart(server: RedisServer, outage_s: float) -> list[list[str]]:
    """The pool's engines: before, right after Redis comes back empty, and once the record
    has been missing a whole TTL after that."""
    record = EngineRecord("127.0.0.1:1", "m", 64, TTL_S)
    pool = EnginePool(GatewaySettings())
    watcher = RegistryWatcher(server.url, pool, GatewayMetrics(), poll_s=0.1)
    views: list[list[str]] = []
    try:
        _register(server, record)
        await watcher.refresh()
        views.append(sorted(pool.engines))
        server.stop()
        await watcher.refresh()  # unreachable: the last view stands
        await asyncio.sleep(outage_s)
        server.start()
        await watcher.refresh()  # reachable again, empty
        views.append(sorted(pool.engines))
        await asyncio.sleep(TTL_S + 0.2)
        await watcher.refresh()
        views.append(sorted(pool.engines))
    finally:
        await watcher.close()
        await pool.close()
    return views


def test_an_outage_longer_than_a_ttl_keeps_engines_until_the_registry_was_seen_empty_a_ttl(
    tmp_path: Path,
) -> None:
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()
    try:
        views = asyncio.run(_watch_through_a_restart(server, outage_s=TTL_S * 1.5))
    finally:
        server.stop()
    assert views[0] == ["127.0.0.1:1"]
    assert views[1] == ["127.0.0.1:1"], "a Redis back from an outage dropped a serving engine"
    assert views[2] == [], "an engine whose record stays missing a whole TTL must leave"


def test_an_engine_of_another_model_seen_before_the_model_was_known_leaves_at_the_next_read(
    tmp_path: Path,
) -> None:
    """Before it knows its model the gateway admits every record; once it does, an engine
    serving another model (a second mesh on the same Redis) must stop being routable now,
    not a whole TTL after it was last seen (its record stays there, renewed)."""
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()
    ours, theirs = (EngineRecord("127.0.0.1:1", "m", 64, 30.0),
                    EngineRecord("127.0.0.1:2", "other", 64, 30.0))

    async def watch() -> tuple[list[str], list[str]]:
        pool = EnginePool(GatewaySettings())
        watcher = RegistryWatcher(server.url, pool, GatewayMetrics(), poll_s=0.1)
        try:
            for record in (ours, theirs):
                _register(server, record)
            await watcher.refresh()
            before = sorted(pool.engines)
            pool.model_name = "m"
            await watcher.refresh()
            return before, sorted(e.address for e in pool.routable())
        finally:
            await watcher.close()
            await pool.close()

    try:
        before, routable = asyncio.run(watch())
    finally:
        server.stop()
    assert before == [ours.address, theirs.address]
    assert routable == [ours.address], "an engine of another model stayed routable"
