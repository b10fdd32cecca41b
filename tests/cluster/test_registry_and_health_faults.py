"""Faults around the gateway's engine pool that need no vLLM engine: a real redis-server, real
gRPC channels, and a `backport gateway` process for its settings check.

Where a dead engine host is needed, a listening socket that never answers stands in for it
(`fake_silent_host`): a host that went away without closing its connections cannot be made
with a real engine here.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from backport.v1 import engine_pb2 as pb
from services.engine.registry import REGISTRY_KEY_PREFIX, EngineRecord
from services.gateway.dispatch import EngineRoute
from services.gateway.engine_pool import EnginePool
from services.gateway.engine_registry import RegistryWatcher
from services.gateway.errors import ServiceUnavailableError
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import Router
from services.gateway.settings import GatewaySettings
from tests.cluster.processes import RedisServer, redis_server_binary
from tests.conftest import REPO_ROOT, free_port

needs_redis = pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fake_silent_host() -> Iterator[str]:
    """Accepts TCP connections and never answers, as a host that vanished mid-connection."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def _register(server: RedisServer, key: str, value: str, ttl_s: float) -> None:
    redis.Redis(port=server.port, socket_timeout=1.0).set(key, value, px=int(ttl_s * 1000))


@needs_redis
def test_a_malformed_registry_key_does_not_hide_the_other_engines(
        redis_server: RedisServer) -> None:
    good = EngineRecord("127.0.0.1:1", "m", 64, ttl_s=30.0)
    _register(redis_server, good.key, good.encode(), good.ttl_s)
    for suffix, value in (("not-json", "hello"), ("old-format", '{"address": "127.0.0.1:2"}'),
                          ("wrong-types", '{"address": "127.0.0.1:3", "model": "m", '
                                          '"max_model_len": 64, "ttl_s": "soon"}')):
        _register(redis_server, REGISTRY_KEY_PREFIX + suffix, value, 30.0)

    async def watch() -> list[str]:
        pool = EnginePool(GatewaySettings())
        watcher = RegistryWatcher(redis_server.url, pool, GatewayMetrics(), poll_s=0.05)
        watching = asyncio.create_task(watcher.run())
        try:
            await asyncio.sleep(0.5)
            assert not watching.done(), f"the registry watcher stopped: {watching!r}"
            return sorted(pool.engines)
        finally:
            watching.cancel()
            await watcher.close()
            await pool.close()

    assert asyncio.run(watch()) == [good.address]


@needs_redis
def test_health_checks_go_on_after_an_engine_leaves_during_its_probe(
        redis_server: RedisServer, fake_silent_host: str) -> None:
    """The registry drops an engine whose host is gone while its 2 s probe is in flight; the
    pool closes its channel, and the health checks must keep watching the other engines."""
    record_ttl_s = 0.5
    record = EngineRecord(fake_silent_host, "m", 64, ttl_s=record_ttl_s)
    _register(redis_server, record.key, record.encode(), record_ttl_s)
    refused_address = f"127.0.0.1:{free_port()}"

    async def watch() -> tuple[bool, str]:
        pool = EnginePool(GatewaySettings(health_interval_s=0.05))
        watcher = RegistryWatcher(redis_server.url, pool, GatewayMetrics(), poll_s=0.05)
        await watcher.refresh()
        assert list(pool.engines) == [fake_silent_host]
        tasks = [asyncio.create_task(watcher.run()), asyncio.create_task(pool.run_health_checks())]
        try:
            deadline = asyncio.get_running_loop().time() + 10
            while fake_silent_host in pool.engines:  # its record expires, then a TTL passes
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the retired channel is closed under the probe
            refused = pool.add(refused_address, is_static=True)
            await asyncio.sleep(1.0)  # health rounds find the refusal at once
            return tasks[1].done(), refused.state_name
        finally:
            for task in tasks:
                task.cancel()
            await watcher.close()
            await pool.close()

    health_checks_ended, refused_state = asyncio.run(watch())
    assert not health_checks_ended, "the health-check task ended"
    assert refused_state == "not_serving"


@pytest.mark.parametrize("keys_file_text", [None, "", "# the key goes here\n\n"])
def test_a_keys_file_without_keys_stops_the_gateway_naming_the_flag(
        tmp_path: Path, keys_file_text: str | None) -> None:
    """No key configured means no check; an empty or missing keys file (a secret not mounted)
    must not start a gateway that lets everyone in."""
    keys_file = tmp_path / "api-keys"
    if keys_file_text is not None:
        keys_file.write_text(keys_file_text)
    # Nothing listens at the tokenizer address: a gateway that starts waits there for minutes.
    command = [sys.executable, "-m", "services.cli", "gateway", "--port", str(free_port()),
               "--tokenizer", f"127.0.0.1:{free_port()}", "--api-keys-file", str(keys_file)]
    try:
        finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the gateway started with no API key to check")
    assert finished.returncode == 2, finished.stderr
    assert "--api-keys-file" in finished.stderr and "Traceback" not in finished.stderr


def test_retries_count_calls_sent_again_and_no_engine_left_is_a_503_at_once() -> None:
    """Two engines whose processes are gone (connections refused): one retry, not two, and
    no backoff spent waiting for a third engine that does not exist."""
    settings = GatewaySettings(max_attempts=3, retry_backoff_s=2.0)

    async def route_to_refusing_engines() -> tuple[float | None, float]:
        pool = EnginePool(settings)
        for _ in range(2):
            pool.add(f"127.0.0.1:{free_port()}", is_static=True)
        metrics = GatewayMetrics()
        route = EngineRoute(pool, Router(settings.routing_policy, block_tokens=16,
                                         affinity_max_tokens=256, load_bound=1.25),
                            metrics, settings, session_key=None)
        started_at = time.monotonic()
        try:
            with pytest.raises(ServiceUnavailableError):
                await route.open(pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3]))
            return (metrics.registry.get_sample_value("backport:engine_retries_total"),
                    time.monotonic() - started_at)
        finally:
            await pool.close()

    num_retries, elapsed_s = asyncio.run(route_to_refusing_engines())
    assert num_retries == 1
    assert elapsed_s < 2 * settings.retry_backoff_s, f"the 503 took {elapsed_s:.1f} s"


@needs_redis
def test_an_engine_leaving_the_registry_during_the_retry_backoff_is_not_called(
        redis_server: RedisServer) -> None:
    """The first engine refuses; the second, chosen for the retry, leaves the registry while
    the backoff runs and the pool closes its channel. The request must end in a 503 (no engine
    left), not in a call on the closed channel (a 500)."""
    settings = GatewaySettings(routing_policy="round_robin", max_attempts=3, retry_backoff_s=3.0)
    refusing, leaving = sorted(f"127.0.0.1:{free_port()}" for _ in range(2))  # refusing first
    record_ttl_s = 1.0
    record = EngineRecord(leaving, "m", 64, ttl_s=record_ttl_s)
    _register(redis_server, record.key, record.encode(), record_ttl_s)

    async def route_while_the_engine_leaves() -> None:
        pool = EnginePool(settings)
        pool.add(refusing, is_static=True)
        watcher = RegistryWatcher(redis_server.url, pool, GatewayMetrics(), poll_s=0.05)
        await watcher.refresh()
        assert sorted(pool.engines) == [refusing, leaving]
        watching = asyncio.create_task(watcher.run())
        route = EngineRoute(pool, Router(settings.routing_policy, block_tokens=16,
                                         affinity_max_tokens=256, load_bound=1.25),
                            GatewayMetrics(), settings, session_key=None)
        try:
            with pytest.raises(ServiceUnavailableError):
                await route.open(pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3]))
            assert leaving not in pool.engines
        finally:
            watching.cancel()
            await watcher.close()
            await pool.close()

    asyncio.run(route_while_the_engine_leaves())
