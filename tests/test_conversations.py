"""Conversations: the two stores alone (Redis a real redis-server), then /v1/conversations and
responses made in a conversation on the shared mesh with the official openai client. Two
replicas sharing one through Redis: tests/cluster/test_gateway_sessions_and_signals.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from services.gateway.conversation_store import (Conversation, InMemoryConversationStore,
                                                 ItemIdTaken, RedisConversationStore)
from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"


def _message(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "user", "content": text}


def _stores(redis_url: str) -> list[InMemoryConversationStore | RedisConversationStore]:
    from redis.asyncio import Redis

    return [InMemoryConversationStore(), RedisConversationStore(Redis.from_url(redis_url))]


def test_the_stores_keep_a_conversation_s_items_in_order_and_forget_a_deleted_one(
        redis_url: str) -> None:
    async def scenario(store: InMemoryConversationStore | RedisConversationStore) -> list[object]:
        conversation = Conversation("conv_a", 1, {"topic": "weather"})
        await store.create(conversation, [_message("msg_1", "one")])
        seen: list[object] = [await store.get("conv_a"),
                              await store.add_items("conv_a", [_message("msg_2", "two"),
                                                               _message("msg_3", "three")]),
                              await store.delete_item("conv_a", "msg_2"),
                              await store.delete_item("conv_a", "msg_2"),
                              await store.update(Conversation("conv_a", 1, {"topic": "rain"}))]
        seen.append([item["id"] for item in await store.items("conv_a") or []])
        seen += [(await store.get("conv_a")).metadata, await store.delete("conv_a"),
                 await store.get("conv_a"), await store.items("conv_a"),
                 await store.add_items("conv_a", [_message("msg_4", "four")]),
                 await store.update(conversation), await store.delete("conv_a")]
        return seen

    for store in _stores(redis_url):
        assert asyncio.run(scenario(store)) == [
            Conversation("conv_a", 1, {"topic": "weather"}), True, True, False, True,
            ["msg_1", "msg_3"], {"topic": "rain"}, True, None, None, False, False, False]


def test_turns_added_at_once_each_land_whole(redis_url: str) -> None:
    """Responses made side by side in one conversation, on any replicas: no turn is lost or
    split by another."""
    async def scenario(store: InMemoryConversationStore | RedisConversationStore) -> list[str]:
        await store.create(Conversation("conv_b", 1), [])
        await asyncio.gather(*(store.add_items("conv_b", [_message(f"in_{turn}", "q"),
                                                          _message(f"out_{turn}", "a")])
                               for turn in range(20)))
        return [item["id"] for item in await store.items("conv_b") or []]

    for store in _stores(redis_url):
        ids = asyncio.run(scenario(store))
        assert len(ids) == 40
        assert all(ids[index + 1] == ids[index].replace("in_", "out_") for index in range(0, 40, 2))


def test_deleting_an_item_is_a_change_that_keeps_the_conversation_longer(redis_url: str) -> None:
    from redis.asyncio import Redis

    async def scenario(store: InMemoryConversationStore | RedisConversationStore) -> bool:
        await store.create(Conversation("conv_t", 1), [_message("msg_1", "one"), _message("msg_2", "two")])
        await asyncio.sleep(0.6)
        await store.delete_item("conv_t", "msg_1")
        await asyncio.sleep(0.6)  # past the TTL from the conversation's making
        return await store.get("conv_t") is not None

    for store in (InMemoryConversationStore(ttl_s=1.0),
                  RedisConversationStore(Redis.from_url(redis_url), ttl_s=1.0)):
        assert asyncio.run(scenario(store))


def test_a_response_s_turn_is_added_once_through_a_redis_blip(redis_url: str) -> None:
    """Paused 3 s: the turn's first try lands unanswered, the next finds it added; trying the
    turn again after adds nothing either."""
    from redis.asyncio import Redis

    async def scenario() -> list[object]:
        redis = Redis.from_url(redis_url, socket_timeout=2.0)
        store = RedisConversationStore(redis)
        try:
            await store.create(Conversation("conv_r", 1), [])
            turn = [_message("msg_in", "q"), _message("msg_out", "a")]
            await redis.execute_command("CLIENT", "PAUSE", 3000, "ALL")
            seen: list[object] = [await store.add_items("conv_r", turn, turn="resp_1"),
                                  await store.add_items("conv_r", turn, turn="resp_1")]
            return [*seen, [item["id"] for item in await store.items("conv_r") or []]]
        finally:
            await redis.aclose()

    assert asyncio.run(scenario()) == [True, True, ["msg_in", "msg_out"]]


def test_an_item_id_the_conversation_has_is_refused_in_the_add_itself(redis_url: str) -> None:
    """Ten adds of one id at once (a client's request and its retry, say): one lands. The
    route checks ids before adding too, but another add may come between its check and add."""
    async def scenario(store: InMemoryConversationStore | RedisConversationStore) -> list[object]:
        await store.create(Conversation("conv_d", 1), [_message("msg_1", "one")])
        outcomes = await asyncio.gather(
            *(store.add_items("conv_d", [_message("msg_dup", "again")]) for _ in range(10)),
            return_exceptions=True)
        seen: list[object] = [sorted(repr(outcome) for outcome in outcomes)]
        try:
            await store.add_items("conv_d", [_message("msg_new", "new"), _message("msg_1", "old")])
        except ItemIdTaken as taken:
            seen.append((taken.index, taken.item_id))
        seen.append([item["id"] for item in await store.items("conv_d") or []])
        await store.delete_item("conv_d", "msg_dup")
        seen.append(await store.add_items("conv_d", [_message("msg_dup", "once more")]))
        return seen

    refused = repr(ItemIdTaken(0, "msg_dup"))
    for store in _stores(redis_url):
        assert asyncio.run(scenario(store)) == [
            sorted(["True"] + [refused] * 9), (1, "msg_1"), ["msg_1", "msg_dup"], True]


def test_a_conversation_stored_before_its_id_set_was_kept_still_refuses_its_ids(
        redis_url: str) -> None:
    """A rolling upgrade: the conversation's items are in Redis, the set of their ids is not."""
    from redis.asyncio import Redis

    async def scenario() -> list[object]:
        redis = Redis.from_url(redis_url)
        store = RedisConversationStore(redis)
        try:
            await store.create(Conversation("conv_o", 1), [_message("msg_1", "one"),
                                                          _message("msg_2", "two")])
            await redis.delete(f"{RedisConversationStore.ITEM_IDS_KEY_PREFIX}conv_o")
            seen: list[object] = []
            try:
                await store.add_items("conv_o", [_message("msg_2", "again")])
            except ItemIdTaken as taken:
                seen.append(taken.item_id)
            seen.append(await store.add_items("conv_o", [_message("msg_3", "three")]))
            return [*seen, [item["id"] for item in await store.items("conv_o") or []]]
        finally:
            await redis.aclose()

    assert asyncio.run(scenario()) == ["msg_2", True, ["msg_1", "msg_2", "msg_3"]]


def test_the_in_process_store_drops_its_oldest_conversation_past_its_bound() -> None:
    store = InMemoryConversationStore(max_conversations=2)

    async def kept() -> list[bool]:
        for index in range(3):
            await store.create(Conversation(f"conv_{index}", 1), [])
        return [await store.get(f"conv_{index}") is not None for index in range(3)]

    assert asyncio.run(kept()) == [False, True, True]


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def test_a_conversation_is_made_read_changed_and_deleted_through_the_openai_client(
        client: openai.OpenAI) -> None:
    conversation = client.conversations.create(
        items=[{"role": "user", "content": "Hello"},
               {"type": "message", "role": "assistant", "content": [
                   {"type": "output_text", "text": "Hi."}]}],
        metadata={"topic": "greetings"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "greetings"}
    assert client.conversations.retrieve(conversation.id) == conversation
    updated = client.conversations.update(conversation.id, metadata={"topic": "farewells"})
    assert updated.metadata == {"topic": "farewells"}
    added = client.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "Bye"}])
    assert [item.role for item in added.data] == ["user"] and added.first_id == added.data[0].id
    newest_first = client.conversations.items.list(conversation.id)
    assert [item.content[0].text for item in newest_first.data] == ["Bye", "Hi.", "Hello"]
    assert [item.content[0].type for item in newest_first.data] == ["input_text", "output_text",
                                                                    "input_text"]
    oldest = newest_first.data[-1]
    assert client.conversations.items.retrieve(oldest.id, conversation_id=conversation.id) == oldest
    assert client.conversations.items.delete(oldest.id, conversation_id=conversation.id).id == conversation.id
    paged = client.conversations.items.list(conversation.id, order="asc", limit=1)
    assert [item.content[0].text for item in paged.data] == ["Hi."] and paged.has_more
    assert [item.content[0].text for item in paged] == ["Hi.", "Bye"]  # the client pages on
    deleted = client.conversations.delete(conversation.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (conversation.id, True, "conversation.deleted")
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)


def test_a_response_in_a_conversation_reads_its_items_and_adds_its_turn(client: openai.OpenAI) -> None:
    """The second turn's prompt is the conversation sent whole: the same tokens, the same
    answer; streamed or not, each turn lands in the conversation."""
    conversation = client.conversations.create(items=[
        {"type": "message", "role": "system", "content": "Answer in one short sentence."}])
    first = client.responses.create(model=MODEL, conversation=conversation.id, temperature=0,
                                    input="What is the capital of France?", max_output_tokens=12)
    assert first.conversation is not None and first.conversation.id == conversation.id
    streamed = list(client.responses.create(
        model=MODEL, conversation={"id": conversation.id}, temperature=0, stream=True,
        input="And of Italy?", max_output_tokens=12))
    second = streamed[-1].response
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    assert [(item.type, item.role) for item in items] == [
        ("message", "system"), ("message", "user"), ("message", "assistant"),
        ("message", "user"), ("message", "assistant")]
    assert [items[2].content[0].text, items[4].content[0].text] == [first.output_text, second.output_text]
    whole = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12, input=[
        item.model_dump(exclude_none=True) for item in items[:4]])
    assert (second.usage.input_tokens, second.output_text) == (whole.usage.input_tokens, whole.output_text)
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [item.id for item in listed] == [item.id for item in items[:4]]


def test_a_background_response_adds_its_turn_once_made_and_store_false_still_adds_one(
        client: openai.OpenAI) -> None:
    conversation = client.conversations.create()
    queued = client.responses.create(model=MODEL, conversation=conversation.id, background=True,
                                     input="Hello", max_output_tokens=4)
    assert client.conversations.items.list(conversation.id).data == []  # not made yet
    for _ in range(600):
        polled = client.responses.retrieve(queued.id)
        if polled.status not in ("queued", "in_progress"):
            break
        asyncio.run(asyncio.sleep(0.1))
    unstored = client.responses.create(model=MODEL, conversation=conversation.id, store=False,
                                       input="Again", max_output_tokens=4)
    texts = [item.content[0].text for item in client.conversations.items.list(conversation.id, order="asc")]
    assert texts == ["Hello", polled.output_text, "Again", unstored.output_text]


HELD_MESSAGE = {"id": "msg_here", "type": "message", "role": "user", "content": "What is the weather?"}
HELD_CALL = {"type": "function_call", "call_id": "call_here", "name": "get_weather", "arguments": "{}"}


def test_a_conversation_needs_no_body_and_its_calls_may_be_answered_later(
        mesh: RunningMesh, client: openai.OpenAI) -> None:
    made = httpx.post(f"{mesh.base_url}/conversations", timeout=60)
    assert made.status_code == 200 and made.json()["object"] == "conversation", made.text
    conversation_id = made.json()["id"]
    client.conversations.items.create(conversation_id, items=[HELD_MESSAGE, HELD_CALL])
    answered = client.conversations.items.create(conversation_id, items=[
        {"type": "function_call_output", "call_id": "call_here", "output": "Sunny"}])
    assert answered.data[0].type == "function_call_output"
    reply = client.responses.create(model=MODEL, conversation=conversation_id, max_output_tokens=4,
                                    input=[{"type": "function_call_output", "call_id": "call_here",
                                            "output": "Still sunny"}])
    assert reply.status in ("completed", "incomplete")


@pytest.mark.parametrize(("method", "path", "body", "status", "param", "problem"), [
    ("POST", "/responses", {"model": MODEL, "input": "Hi", "conversation": "conv_none"}, 404,
     "conversation", "conv_none"),
    ("POST", "/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, 400, "items",
     "at most 20"),
    ("POST", "/conversations", {"items": [{"type": "web_search_call"}]}, 400, "items",
     "items[0]: unsupported item type"),
    ("POST", "/conversations", {"metadata": {f"k{index}": "v" for index in range(17)}}, 400,
     "metadata", "at most 16 pairs"),
    ("POST", "/conversations", {"metadata": {"k": "v" * 513}}, 400, "metadata", "512"),
    ("POST", "/conversations", {"items": [{"role": "user", "content": "\ud800"}]}, 400, "items",
     "surrogate"),
    ("POST", "/conversations/{id}", {}, 400, "metadata", "metadata"),
    ("POST", "/conversations/{id}/items", {"items": []}, 400, "items", "empty"),
    ("POST", "/conversations/conv_none/items", {"items": [{"role": "user", "content": "x"}]}, 404,
     None, "conv_none"),
    ("GET", "/conversations/{id}/items?after=msg_none", None, 400, "after",
     "no item of this conversation"),
    ("GET", "/conversations/{id}/items?limit=101", None, 400, "limit", "100"),
    ("GET", "/conversations/{id}/items/msg_none", None, 404, None, "msg_none"),
    ("DELETE", "/conversations/{id}/items/msg_none", None, 404, None, "msg_none"),
    ("DELETE", "/conversations/conv_none", None, 404, None, "conv_none"),
    ("POST", "/conversations", {"items": [{"id": "msg_a", "role": "user", "content": "x"}] * 2}, 400,
     "items", "items[1].id: items[0] has the same id, 'msg_a'"),
    ("POST", "/conversations/{id}/items", {"items": [{"id": "msg_here", "role": "user", "content": "x"}]},
     400, "items", "items[0].id: the conversation already has an item with id 'msg_here'"),
    ("POST", "/responses", {"model": MODEL, "conversation": "{id}", "input": [
        {"id": "msg_here", "role": "user", "content": "x"}]}, 400, "input", "input[0].id"),
    ("POST", "/conversations", {"items": [{"type": "function_call_output", "call_id": "call_9",
                                           "output": "x"}]}, 400, "items",
     "items[0]: no function_call item before it has call_id 'call_9'"),
    ("POST", "/responses", {"model": MODEL, "input": "Hi", "conversation": {}}, 400, "conversation",
     "must be a conversation id"),
])
def test_bad_conversation_requests_get_openai_errors_naming_the_field(
        mesh: RunningMesh, client: openai.OpenAI, method: str, path: str, body: Any, status: int,
        param: str | None, problem: str) -> None:
    conversation = client.conversations.create(items=[HELD_MESSAGE, HELD_CALL])
    # ASCII JSON: a lone surrogate escaped, as a client's JSON encoder sends it.
    reply = httpx.request(method, mesh.base_url + path.format(id=conversation.id),
                          content=json.dumps(body).replace("{id}", conversation.id)
                          if body is not None else None,
                          headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and problem in error["message"], reply.text
