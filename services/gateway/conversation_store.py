"""Conversations of OpenAI's Conversations API: their metadata and items, oldest first.

A conversation is kept for `ttl_s` from its last change (the gateway's `--response-ttl-s`, as
responses are). In Redis where the gateway has `--redis-url`, so that every replica sees it:
`backport:conversation:<id>` holds the conversation, `backport:conversation-items:<id>` its items
as a list of JSON and `backport:conversation-item-ids:<id>` the set of their ids. Items are added
in one step (a Lua script that also finds the conversation still there and none of their ids
taken), whatever other turns are added beside them. Else in this process, bounded as the
in-memory responses are.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from services.gateway.expiring_texts import ExpiringTexts
from services.gateway.redis_calls import redis_call, redis_call_retried
from services.gateway.response_store import DEFAULT_TTL_S, LEASE_S

if TYPE_CHECKING:
    from redis.asyncio import Redis


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)

    def to_object(self) -> dict[str, Any]:
        """As the API returns it."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}

    def encode(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def decode(cls, text: str | bytes) -> Conversation:
        return cls(**json.loads(text))


class ItemIdTaken(Exception):
    """An item added carries an id the conversation already has; nothing was added."""

    def __init__(self, index: int, item_id: str) -> None:
        super().__init__(f"the conversation already has an item with id {item_id!r}")
        self.index = index  # in the items given to add
        self.item_id = item_id


class ConversationStore(Protocol):
    async def create(self, conversation: Conversation, items: list[dict[str, Any]]) -> None: ...

    async def get(self, conversation_id: str) -> Conversation | None: ...

    async def update(self, conversation: Conversation) -> bool:
        """Whether the conversation was there to update."""
        ...

    async def delete(self, conversation_id: str) -> bool:
        """Whether there was such a conversation."""
        ...

    async def items(self, conversation_id: str) -> list[dict[str, Any]] | None:
        """Its items, oldest first; None where there is no such conversation."""
        ...

    async def add_items(self, conversation_id: str, items: list[dict[str, Any]], *,
                        turn: str | None = None) -> bool:
        """Adds the items after those it has; whether the conversation was there. A response's
        `turn` (its id) is added once, however often it is tried, and tried again through a
        Redis blip: no client is there to try it. Raises ItemIdTaken, adding nothing, where an
        item's id is one the conversation has, checked in the same step as the add."""
        ...

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        """Whether it had such an item."""
        ...


class InMemoryConversationStore:
    """One process's conversations, each with its items as one text: the oldest go first once
    more than `max_conversations`, or `max_chars` characters of them, are held."""

    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S, max_conversations: int = 4096,
                 max_chars: int = 256 * 2**20, clock: Callable[[], float] = time.monotonic) -> None:
        self._held = ExpiringTexts(ttl_s=ttl_s, max_count=max_conversations, max_chars=max_chars,
                                   clock=clock)

    async def create(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        self._put(conversation, items)

    async def get(self, conversation_id: str) -> Conversation | None:
        held = self._read(conversation_id)
        return held[0] if held is not None else None

    async def update(self, conversation: Conversation) -> bool:
        held = self._read(conversation.id)
        if held is not None:
            self._put(conversation, held[1])
        return held is not None

    async def delete(self, conversation_id: str) -> bool:
        return self._held.pop(conversation_id) is not None

    async def items(self, conversation_id: str) -> list[dict[str, Any]] | None:
        held = self._read(conversation_id)
        return held[1] if held is not None else None

    async def add_items(self, conversation_id: str, items: list[dict[str, Any]], *,
                        turn: str | None = None) -> bool:
        # Nothing here fails part way or awaits: a turn is never tried twice, and no other add
        # comes between the check of the ids and the add.
        held = self._read(conversation_id)
        if held is None:
            return False
        held_ids = {item.get("id") for item in held[1]}
        for index, item in enumerate(items):
            if item.get("id") in held_ids:
                raise ItemIdTaken(index, item["id"])
        self._put(held[0], [*held[1], *items])
        return True

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        held = self._read(conversation_id)
        if held is None:
            return False
        conversation, items = held
        for index, item in enumerate(items):
            if item.get("id") == item_id:
                self._put(conversation, items[:index] + items[index + 1:])
                return True
        return False

    def _read(self, conversation_id: str) -> tuple[Conversation, list[dict[str, Any]]] | None:
        text = self._held.get(conversation_id)
        if text is None:
            return None
        held = json.loads(text)
        return Conversation(**held["conversation"]), held["items"]

    def _put(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        # Encoded, as Redis keeps it: what a caller later changes in its dicts changes nothing.
        self._held.put(conversation.id, json.dumps(
            {"conversation": asdict(conversation), "items": items}, ensure_ascii=False))


# KEYS: the conversation, its items, their ids, a turn's mark. ARGV: 1 where the items are a
# turn, the TTL in ms, the number of items n, the items' JSON, then their n ids. 1 where added
# or added before as this turn, 0 where there is no conversation, -k where item k's id is taken.
_ADD_ITEMS = """
local is_turn = ARGV[1] == '1'
if is_turn and redis.call('EXISTS', KEYS[4]) == 1 then return 1 end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = tonumber(ARGV[3])
if redis.call('EXISTS', KEYS[3]) == 0 then
  -- No id set: no items, or a conversation stored before the set was kept. Learn its ids.
  for _, text in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
    local id = cjson.decode(text)['id']
    if type(id) == 'string' then redis.call('SADD', KEYS[3], id) end
  end
end
for k = 1, n do
  if redis.call('SISMEMBER', KEYS[3], ARGV[3 + n + k]) == 1 then return -k end
end
redis.call('RPUSH', KEYS[2], unpack(ARGV, 4, 3 + n))
redis.call('SADD', KEYS[3], unpack(ARGV, 4 + n, 3 + 2 * n))
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
if is_turn then redis.call('SET', KEYS[4], '1', 'PX', ARGV[2]) end
return 1
"""


class RedisConversationStore:
    """Conversations shared by every gateway replica, each for `ttl_s` from its last change;
    on the Redis client of the gateway's response store."""

    KEY_PREFIX = "backport:conversation:"
    ITEMS_KEY_PREFIX = "backport:conversation-items:"
    ITEM_IDS_KEY_PREFIX = "backport:conversation-item-ids:"
    # Marks a response's turn added, so that a try again after one that landed unanswered
    # adds nothing: `backport:conversation-turn:<conversation id>:<response id>`.
    TURN_KEY_PREFIX = "backport:conversation-turn:"
    # How long a turn is tried again: within a background response's lease, as its own writes.
    TURN_RETRY_S = LEASE_S / 2

    def __init__(self, redis: Redis, *, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self._redis = redis
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._add_items = redis.register_script(_ADD_ITEMS)

    async def create(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        pipeline = self._redis.pipeline(transaction=True)
        pipeline.set(self._key(conversation.id), conversation.encode(), px=self._ttl_ms)
        if items:
            pipeline.rpush(self._items_key(conversation.id), *map(_encoded, items))
            pipeline.sadd(self._item_ids_key(conversation.id), *(item["id"] for item in items))
            pipeline.pexpire(self._items_key(conversation.id), self._ttl_ms)
            pipeline.pexpire(self._item_ids_key(conversation.id), self._ttl_ms)
        await self._call(pipeline.execute())

    async def get(self, conversation_id: str) -> Conversation | None:
        text = await self._call(self._redis.get(self._key(conversation_id)))
        return Conversation.decode(text) if text is not None else None

    async def update(self, conversation: Conversation) -> bool:
        pipeline = self._redis.pipeline(transaction=True)
        pipeline.set(self._key(conversation.id), conversation.encode(), px=self._ttl_ms, xx=True)
        pipeline.pexpire(self._items_key(conversation.id), self._ttl_ms)
        pipeline.pexpire(self._item_ids_key(conversation.id), self._ttl_ms)
        updated, _, _ = await self._call(pipeline.execute())
        return bool(updated)

    async def delete(self, conversation_id: str) -> bool:
        deleted = await self._call(self._redis.delete(self._key(conversation_id),
                                                      self._items_key(conversation_id),
                                                      self._item_ids_key(conversation_id)))
        return bool(deleted)

    async def items(self, conversation_id: str) -> list[dict[str, Any]] | None:
        pipeline = self._redis.pipeline(transaction=True)
        pipeline.exists(self._key(conversation_id))
        pipeline.lrange(self._items_key(conversation_id), 0, -1)
        exists, texts = await self._call(pipeline.execute())
        return [json.loads(text) for text in texts] if exists else None

    async def add_items(self, conversation_id: str, items: list[dict[str, Any]], *,
                        turn: str | None = None) -> bool:
        if not items:
            return await self.get(conversation_id) is not None
        def add() -> Awaitable[Any]:
            return self._add_items(
                keys=[self._key(conversation_id), self._items_key(conversation_id),
                      self._item_ids_key(conversation_id),
                      f"{self.TURN_KEY_PREFIX}{conversation_id}:{turn or ''}"],
                args=[int(turn is not None), self._ttl_ms, len(items), *map(_encoded, items),
                      *(item["id"] for item in items)])

        if turn is None:
            outcome = await self._call(add())
        else:
            outcome = await redis_call_retried(add, "conversation store",
                                               retry_s=self.TURN_RETRY_S)
        if outcome < 0:
            raise ItemIdTaken(-outcome - 1, items[-outcome - 1]["id"])
        return bool(outcome)

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        key = self._items_key(conversation_id)
        for text in await self._call(self._redis.lrange(key, 0, -1)):
            if json.loads(text).get("id") == item_id:
                # The very text, wherever other turns have put it in the meantime.
                pipeline = self._redis.pipeline(transaction=True)
                pipeline.lrem(key, 1, text)
                pipeline.srem(self._item_ids_key(conversation_id), item_id)
                pipeline.pexpire(self._key(conversation_id), self._ttl_ms)
                pipeline.pexpire(key, self._ttl_ms)
                pipeline.pexpire(self._item_ids_key(conversation_id), self._ttl_ms)
                removed, *_ = await self._call(pipeline.execute())
                return bool(removed)
        return False

    def _key(self, conversation_id: str) -> str:
        return f"{self.KEY_PREFIX}{conversation_id}"

    def _items_key(self, conversation_id: str) -> str:
        return f"{self.ITEMS_KEY_PREFIX}{conversation_id}"

    def _item_ids_key(self, conversation_id: str) -> str:
        return f"{self.ITEM_IDS_KEY_PREFIX}{conversation_id}"

    async def _call(self, pending: Any) -> Any:
        return await redis_call(pending, "conversation store")


def _encoded(item: dict[str, Any]) -> str:
    return json.dumps(item, ensure_ascii=False)
