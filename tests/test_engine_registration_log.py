"""The engine's registration in a real Redis (a redis-server with a password), as its log
tells it: "registered" once the record is written, never the URL's password, and a warning
instead while the registry cannot be reached."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from services.engine.registry import REGISTRY_KEY_PREFIX, EngineRecord, EngineRegistration
from tests.cluster.processes import RedisServer, redis_server_binary
from tests.conftest import free_port

PASSWORD = "s3cret-registry-password"
ADDRESS = "10.1.2.3:50051"

pytestmark = pytest.mark.skipif(redis_server_binary() is None,
                                reason="redis-server is not installed")


def record() -> EngineRecord:
    return EngineRecord(address=ADDRESS, model="m", max_model_len=2048, ttl_s=3.0)


def keys_while_registered(url: str, registry: RedisServer | None) -> list[str]:
    """The registry's keys while registered through `url` (none read without a registry)."""
    async def run() -> list[str]:
        registration = EngineRegistration(url, record)
        await registration.start()
        try:
            return [] if registry is None else registry.keys(REGISTRY_KEY_PREFIX + "*")
        finally:
            await registration.deregister()

    return asyncio.run(run())


def test_the_log_says_where_it_registered_without_the_password(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The log line had held the whole URL, password included."""
    registry = RedisServer(free_port(), tmp_path / "redis.log", password=PASSWORD)
    registry.start()
    try:
        with caplog.at_level(logging.INFO, logger="services.engine.registry"):
            keys = keys_while_registered(registry.url, registry)
    finally:
        registry.stop()
    assert keys == [REGISTRY_KEY_PREFIX + ADDRESS]
    assert f"registered {ADDRESS} in the registry at 127.0.0.1:{registry.port} db 0" in caplog.text
    assert PASSWORD not in caplog.text


def test_a_registry_out_of_reach_is_a_warning_not_a_registration(
        caplog: pytest.LogCaptureFixture) -> None:
    """It had logged "registered" after a first write that failed."""
    port = free_port()  # nothing listens there
    with caplog.at_level(logging.INFO, logger="services.engine.registry"):
        keys_while_registered(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", None)
    assert "registered" not in caplog.text
    assert f"cannot write the registry at 127.0.0.1:{port} db 0" in caplog.text
    assert PASSWORD not in caplog.text
