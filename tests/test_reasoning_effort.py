"""DeepSeek-V4-Flash-0731 effort mapping and sticky effort per session (in memory and in Redis)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.gateway.reasoning_effort import (
    CHAT,
    DEFAULT_EFFORT,
    Effort,
    EffortRequestError,
    InMemorySessionEffortStore,
    RedisSessionEffortStore,
    SessionEffortStore,
    passthrough_template_kwargs,
    requested_effort,
    resolve_session_effort,
    session_key,
)
from tests.cluster.processes import RedisServer, redis_server_binary
from tests.conftest import free_port

HIGH, LOW, MAX = Effort(True, "high"), Effort(True, "low"), Effort(True, "max")


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"chat_template_kwargs": {"unrelated": 1}}, None),
    ({"reasoning_effort": "none"}, CHAT),
    ({"reasoning_effort": "minimal"}, LOW),
    ({"reasoning_effort": "low"}, LOW),
    ({"reasoning_effort": "medium"}, LOW),
    ({"reasoning_effort": "high"}, HIGH),
    ({"reasoning_effort": "xhigh"}, HIGH),
    ({"reasoning_effort": "max"}, MAX),
    ({"reasoning_effort": "turbo"}, HIGH),
    ({"thinking": True}, HIGH),
    ({"thinking": False}, CHAT),
    ({"thinking": {"type": "enabled"}}, HIGH),
    ({"thinking": {"type": "disabled"}, "chat_template_kwargs": {"reasoning_effort": "max"}}, CHAT),
    ({"chat_template_kwargs": {"thinking": False}}, CHAT),
    ({"chat_template_kwargs": {"enable_thinking": False}}, CHAT),
    ({"chat_template_kwargs": {"thinking": True, "reasoning_effort": "medium"}}, LOW),
    ({"chat_template_kwargs": {"reasoning_effort": "max"}}, MAX),
    ({"chat_template_kwargs": {"reasoning_effort": "none"}}, CHAT),
    # The request-level effort wins over the kwargs one and turns thinking on, as in vLLM.
    ({"reasoning_effort": "max", "chat_template_kwargs": {"reasoning_effort": "low"}}, MAX),
    ({"reasoning_effort": "max", "chat_template_kwargs": {"thinking": False}}, MAX),
    ({"reasoning_effort": "max", "chat_template_kwargs": {"enable_thinking": False}}, CHAT),
])
def test_mapping_table(fields: dict[str, Any], expected: Effort | None) -> None:
    assert requested_effort(**fields) == expected


@pytest.mark.parametrize(("fields", "field"), [
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"chat_template_kwargs": {"reasoning_effort": ["high"]}}, "chat_template_kwargs.reasoning_effort"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
])
def test_malformed_effort_fields_are_rejected(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(EffortRequestError) as caught:
        requested_effort(**fields)
    assert caught.value.field == field


def test_template_kwargs_keep_other_keys_and_set_both_thinking_switches() -> None:
    assert MAX.template_kwargs({"custom": 1, "thinking": False}) == {
        "custom": 1, "thinking": True, "enable_thinking": True, "reasoning_effort": "max"}
    assert CHAT.template_kwargs(None) == {"thinking": False, "enable_thinking": False, "reasoning_effort": "none"}
    assert DEFAULT_EFFORT == HIGH


def test_template_models_get_the_request_effort_untouched() -> None:
    assert passthrough_template_kwargs(None, None) == {}
    assert passthrough_template_kwargs("medium", {"x": 1}) == {"x": 1, "reasoning_effort": "medium",
                                                               "enable_thinking": True}
    assert passthrough_template_kwargs("none", None) == {"reasoning_effort": "none", "enable_thinking": False}
    assert passthrough_template_kwargs("low", {"enable_thinking": False})["enable_thinking"] is False


def test_session_key_prefers_header_then_prompt_cache_key_then_user() -> None:
    assert session_key(session_id="h", prompt_cache_key="p", user="u") == "h"
    assert session_key(session_id="", prompt_cache_key="p", user="u") == "p"
    assert session_key(session_id=None, prompt_cache_key=None, user="u") == "u"
    assert session_key(session_id=None, prompt_cache_key=None, user=None) is None
    long_key = session_key(session_id="x" * 1000, prompt_cache_key=None, user=None)
    assert long_key is not None and long_key.startswith("sha256:") and len(long_key) == 71


@pytest.mark.parametrize("encoded", [effort.encode() for effort in (CHAT, LOW, HIGH, MAX)])
def test_stored_form_round_trips(encoded: str) -> None:
    assert Effort.decode(encoded).encode() == encoded
    assert Effort.decode(encoded.encode()).encode() == encoded


async def _three_turns(store: SessionEffortStore) -> list[Effort]:
    """An agentic session: effort on the first turn only, then a fresh session without any."""
    turns = [
        ({"reasoning_effort": "max"}, "agent-1"),
        ({}, "agent-1"),
        ({"chat_template_kwargs": {"unrelated": True}}, "agent-1"),
        ({"reasoning_effort": "low"}, "agent-1"),
        ({}, "agent-1"),
        ({}, "agent-2"),
        ({"reasoning_effort": "none"}, "agent-3"),
        ({}, "agent-3"),
    ]
    return [await resolve_session_effort(requested_effort(**fields), session, store) for fields, session in turns]


def test_sticky_effort_across_turns_in_memory() -> None:
    efforts = asyncio.run(_three_turns(InMemorySessionEffortStore()))
    # A later explicit effort is served but does not replace the session's first.
    assert efforts == [MAX, MAX, MAX, LOW, MAX, HIGH, CHAT, CHAT]


def test_requests_without_a_session_get_the_default() -> None:
    store = InMemorySessionEffortStore()
    assert asyncio.run(resolve_session_effort(None, None, store)) == HIGH
    assert asyncio.run(resolve_session_effort(MAX, None, store)) == MAX
    assert len(store) == 0


def test_in_memory_sessions_expire_after_idle_ttl_and_stay_bounded() -> None:
    now = [0.0]
    store = InMemorySessionEffortStore(ttl_s=10, max_sessions=2, clock=lambda: now[0])

    async def scenario() -> list[Effort]:
        seen = [await store.remember_first("a", MAX)]
        now[0] = 9.0
        seen.append(await store.remember_first("a", HIGH))  # used: lifetime refreshed to 19
        now[0] = 18.0
        seen.append(await store.remember_first("a", HIGH))
        now[0] = 40.0
        seen.append(await store.remember_first("a", LOW))  # idle past the TTL: a new session
        await store.remember_first("b", HIGH)
        await store.remember_first("c", HIGH)  # third session: the least recently used ("a") goes
        seen.append(await store.remember_first("a", CHAT))
        return seen

    assert asyncio.run(scenario()) == [MAX, MAX, MAX, LOW, CHAT]
    assert len(store) == 2


def test_sticky_effort_across_turns_in_redis(redis_url: str) -> None:
    async def scenario() -> tuple[list[Effort], bytes | None, int, Effort]:
        store = RedisSessionEffortStore.from_url(redis_url, ttl_s=3600)
        try:
            efforts = await _three_turns(store)
            from redis.asyncio import Redis
            raw = Redis.from_url(redis_url)
            key = "backport:session:agent-1:effort"
            stored, ttl_s = await raw.get(key), await raw.ttl(key)
            await raw.set("backport:session:broken:effort", "garbage")
            recovered = await store.remember_first("broken", LOW)
            await raw.aclose()
            return efforts, stored, ttl_s, recovered
        finally:
            await store.aclose()

    efforts, stored, ttl_s, recovered = asyncio.run(scenario())
    assert efforts == [MAX, MAX, MAX, LOW, MAX, HIGH, CHAT, CHAT]
    assert stored == b"thinking:max"
    assert 3500 < ttl_s <= 3600
    assert recovered == LOW


def test_concurrent_first_requests_agree_in_redis(redis_url: str) -> None:
    async def scenario() -> list[Effort]:
        stores = [RedisSessionEffortStore.from_url(redis_url) for _ in range(4)]
        try:
            return list(await asyncio.gather(*(
                store.remember_first("race", effort) for store, effort in zip(stores, (LOW, HIGH, MAX, CHAT)))))
        finally:
            for store in stores:
                await store.aclose()

    winners = asyncio.run(scenario())
    assert len(set(winners)) == 1


@pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server")
def test_requests_are_served_at_their_own_effort_while_redis_is_away(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()

    async def scenario() -> list[Effort]:
        store = RedisSessionEffortStore.from_url(server.url)
        try:
            opened = await store.remember_first("agent-2", MAX)
            server.stop()
            during = [await store.remember_first("agent-2", LOW),
                      await store.remember_first("agent-2", DEFAULT_EFFORT)]
            server.start()  # back, and sticky again
            after = [await store.remember_first("agent-3", LOW),
                     await store.remember_first("agent-3", MAX)]
            return [opened, *during, *after]
        finally:
            await store.aclose()

    try:
        efforts = asyncio.run(scenario())
    finally:
        server.stop()
    assert efforts == [MAX, LOW, DEFAULT_EFFORT, LOW, LOW]
    assert "session effort store unavailable" in caplog.text
