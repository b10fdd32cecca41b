"""Stored responses of the Responses API: `store`, `previous_response_id`, GET and DELETE.

A response is kept whole, for `ttl_s` from when it was made: with every input item of its
conversation, those of the responses it continued included, so that it can be continued as long
as it is kept, whatever became of them (as vLLM keeps each response's whole message list). A
request naming `previous_response_id` gets those items and that response's output before its own
input; instructions are not carried over (OpenAI's rule).

Kept in Redis (key `backport:response:<id>`, JSON) where the gateway has `--redis-url`, so every
replica sees every response; else in this process, the oldest dropped first past
`max_responses`, or `max_chars` of JSON (logprobs make a response large).

A background response is stopped through the store too (`request_stop`, key
`backport:response-stop:<id>`): the replica generating it looks there, whichever replica was
asked to cancel or delete it, and its writes (`unless_stopped`) are refused from then on, in the
same step as the check (a Lua script in Redis), so that none lands after the cancel or delete.
A streamed one's events are kept there as well, for as long as the response, so that any
replica can stream them again (`events_after`; a Redis stream `backport:response-events:<id>`,
entry `n+1-0` holding event `n`).

In Redis a running background response is leased to the gateway making it (key
`backport:response-lease:<id>`, `lease_s`), which renews the lease as it looks for a stop
(`renew_lease`). A lease that lapsed means that gateway died or lost Redis: the response reads
`failed` from then on, its stream's readers get its end (`BackgroundResponseLostError`), and its
generator's writes are refused, so that it cannot come back to life.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from services.gateway.errors import InvalidRequestError
from services.gateway.expiring_texts import ExpiringTexts
from services.gateway.redis_calls import redis_call, redis_call_retried

if TYPE_CHECKING:
    from redis.asyncio import Redis

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 3600.0

# The statuses of a background response still being generated.
RUNNING_STATUSES = frozenset({"queued", "in_progress"})
# Why a background response was stopped: what its generator writes then.
StopReason = Literal["cancelled", "deleted"]
STOP_REASONS: tuple[StopReason, ...] = get_args(StopReason)
# Why a background response's generator must stop: a stop was asked, or its lease lapsed.
GeneratorStop = StopReason | Literal["lease_lapsed"]

# How long a background response stays leased to its gateway without a renewal: many of the
# generator's looks for a stop (a second apart), so that only a gateway gone lets it lapse.
LEASE_S = 10.0
LAPSED_MESSAGE = ("the gateway making the response stopped before it ended (its lease in the "
                  "response store lapsed)")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    # The conversation's input items up to this response, oldest first.
    input_items: list[dict[str, Any]]

    @property
    def id(self) -> str:
        return self.response["id"]

    def encode(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def decode(cls, text: str | bytes) -> StoredResponse:
        return cls(**json.loads(text))

    @property
    def is_running(self) -> bool:
        return self.response.get("status") in RUNNING_STATUSES

    def lapsed(self) -> StoredResponse:
        """The running response as its lapsed lease leaves it: failed."""
        error = {"code": "server_error", "message": LAPSED_MESSAGE}
        return StoredResponse({**self.response, "status": "failed", "error": error}, self.input_items)


class BackgroundResponseLostError(Exception):
    """A background response's stream will not go on: the lease of its gateway lapsed with
    `num_events` events stored."""

    def __init__(self, response_id: str, num_events: int) -> None:
        super().__init__(f"background response {response_id}: its gateway's lease lapsed")
        self.num_events = num_events


class PreviousResponseNotFoundError(InvalidRequestError):
    code = "previous_response_not_found"


class ResponseStore(Protocol):
    async def put(self, record: StoredResponse, *, unless_stopped: bool = False) -> bool:
        """Whether it was written: not where `unless_stopped` (the generator's writes) and a
        stop was requested or the lease lapsed. A running response is leased from its first
        write on."""
        ...

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str) -> bool:
        """Whether there was such a response."""
        ...

    async def request_stop(self, response_id: str, reason: StopReason) -> None: ...

    async def renew_lease(self, response_id: str) -> GeneratorStop | None:
        """Renews the running response's lease, unless it must stop: then why."""
        ...

    async def append_event(self, response_id: str, number: int, event: str, *,
                           unless_stopped: bool = False) -> bool:
        """Adds event `number` (0, 1, ... in order) of a background response's stream; whether
        it was, as for `put`."""
        ...

    async def end_events(self, response_id: str, number: int, *,
                         unless_stopped: bool = False) -> None:
        """Ends the stream, whose last event was `number - 1`."""
        ...

    async def has_events(self, response_id: str) -> bool: ...

    def events_after(self, response_id: str, number: int) -> AsyncGenerator[str, None]:
        """The stream's events after event `number` (-1: all), each as it is added, until the
        stream ends or is deleted with its response; `BackgroundResponseLostError` where
        neither will come."""
        ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class _EventLog:
    events: list[str] = field(default_factory=list)
    num_chars: int = 0
    has_ended: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class InMemoryResponseStore:
    """One process's responses, each kept `ttl_s`; the oldest go first once more than
    `max_responses`, or `max_chars` characters of their JSON, are held (background streams'
    events likewise, apart). Kept encoded, as Redis
    keeps them: what a caller later changes in the dicts it stored does not change the store."""

    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S, max_responses: int = 4096,
                 max_chars: int = 256 * 2**20, clock: Callable[[], float] = time.monotonic) -> None:
        self._records = ExpiringTexts(ttl_s=ttl_s, max_count=max_responses, max_chars=max_chars,
                                      clock=clock)
        self._ttl_s = ttl_s
        self._max_responses = max_responses
        self._max_chars = max_chars
        self._clock = clock
        # Kept past a DELETE of their response, whose generator looks for them; each for `ttl_s`.
        self._stops: dict[str, tuple[StopReason, float]] = {}
        # Each for `ttl_s` from its first event; the oldest go first past `max_responses` of
        # them, or `max_chars` characters of events.
        self._event_logs: OrderedDict[str, tuple[_EventLog, float]] = OrderedDict()
        self._num_event_chars = 0

    async def put(self, record: StoredResponse, *, unless_stopped: bool = False) -> bool:
        if unless_stopped and await self.stop_requested(record.id):
            return False
        self._records.put(record.id, record.encode())
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        text = self._records.get(response_id)
        return StoredResponse.decode(text) if text is not None else None

    async def delete(self, response_id: str) -> bool:
        await self._drop_events(response_id)
        return self._records.pop(response_id) is not None

    async def request_stop(self, response_id: str, reason: StopReason) -> None:
        now = self._clock()
        self._stops = {id_: stop for id_, stop in self._stops.items() if stop[1] > now}
        self._stops[response_id] = (reason, now + self._ttl_s)

    async def renew_lease(self, response_id: str) -> GeneratorStop | None:
        # Made in this process, which holds the store: no lease to lapse.
        return await self.stop_requested(response_id)

    async def stop_requested(self, response_id: str) -> StopReason | None:
        stop = self._stops.get(response_id)
        return stop[0] if stop is not None and stop[1] > self._clock() else None

    async def append_event(self, response_id: str, number: int, event: str, *,
                           unless_stopped: bool = False) -> bool:
        if unless_stopped and await self.stop_requested(response_id):
            return False
        log = self._event_log(response_id)
        if log is None:
            if number:
                return False  # dropped while it was being written
            now = self._clock()
            while self._event_logs and (len(self._event_logs) >= self._max_responses
                                        or next(iter(self._event_logs.values()))[1] <= now):
                await self._drop_events(next(iter(self._event_logs)))
            log = _EventLog()
            self._event_logs[response_id] = (log, now + self._ttl_s)
        async with log.changed:
            log.events.append(event)
            log.num_chars += len(event)
            log.changed.notify_all()
        self._num_event_chars += len(event)
        while self._num_event_chars > self._max_chars and next(iter(self._event_logs)) != response_id:
            await self._drop_events(next(iter(self._event_logs)))
        return True

    async def end_events(self, response_id: str, number: int, *,
                         unless_stopped: bool = False) -> None:
        log = self._event_log(response_id)
        if log is not None and not (unless_stopped and await self.stop_requested(response_id)):
            await self._end(log)

    async def has_events(self, response_id: str) -> bool:
        return self._event_log(response_id) is not None

    async def events_after(self, response_id: str, number: int) -> AsyncGenerator[str, None]:
        log = self._event_log(response_id)
        if log is None:
            return
        index = number + 1
        while True:
            async with log.changed:
                await log.changed.wait_for(lambda: len(log.events) > index or log.has_ended)
            while index < len(log.events):
                yield log.events[index]
                index += 1
            if log.has_ended:
                return

    def _event_log(self, response_id: str) -> _EventLog | None:
        held = self._event_logs.get(response_id)
        return held[0] if held is not None and held[1] > self._clock() else None

    async def _drop_events(self, response_id: str) -> None:
        held = self._event_logs.pop(response_id, None)
        if held is not None:
            self._num_event_chars -= held[0].num_chars
            await self._end(held[0])  # its readers stop

    @staticmethod
    async def _end(log: _EventLog) -> None:
        async with log.changed:
            log.has_ended = True
            log.changed.notify_all()

    async def aclose(self) -> None:
        for response_id in list(self._event_logs):
            await self._drop_events(response_id)
        self._records.clear()
        self._stops.clear()


# KEYS: the response, its stop, its lease. ARGV: the JSON, the TTL in ms, 1 for a generator's
# write (refused once stopped or unleased), the lease to set in ms (0: none). 1 where written.
_PUT = """
if ARGV[3] == '1' and (redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 0) then
    return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if ARGV[4] ~= '0' then redis.call('SET', KEYS[3], '1', 'PX', ARGV[4]) end
return 1
"""
# KEYS: the events' stream, the response's stop, its lease. ARGV: the entry id, its field and
# value, the TTL in ms, 1 for a generator's write. 1 where added, or there already (a write
# tried again after its first try landed unanswered).
_ADD_ENTRY = """
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) > 0 then return 1 end
if ARGV[5] == '1' and (redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 0) then
    return 0
end
redis.call('XADD', KEYS[1], ARGV[1], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""
# KEYS: the stop, the lease. ARGV: the lease in ms. The stop's reason, 'lease_lapsed', or nil
# where renewed.
_RENEW_LEASE = """
local reason = redis.call('GET', KEYS[1])
if reason then return reason end
if redis.call('PEXPIRE', KEYS[2], ARGV[1]) == 0 then return 'lease_lapsed' end
return false
"""


class RedisResponseStore:
    """Responses shared by every gateway replica, in Redis, each for `ttl_s` from its making."""

    KEY_PREFIX = "backport:response:"
    STOP_KEY_PREFIX = "backport:response-stop:"
    LEASE_KEY_PREFIX = "backport:response-lease:"
    EVENTS_KEY_PREFIX = "backport:response-events:"
    # How long a reader's XREAD waits for the next event before it looks whether the stream is
    # still there: under the client's 2 s socket timeout.
    EVENTS_WAIT_MS = 1000
    # How long a background response's own calls are made again (`_retried`): well within its
    # lease.
    RETRY_S = LEASE_S / 2

    def __init__(self, redis: Redis, *, ttl_s: float = DEFAULT_TTL_S, lease_s: float = LEASE_S) -> None:
        if ttl_s <= 0 or lease_s <= 0:
            raise ValueError("ttl_s and lease_s must be positive")
        self._redis = redis
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._lease_ms = max(1, round(lease_s * 1000))
        self._put = redis.register_script(_PUT)
        self._add_entry_script = redis.register_script(_ADD_ENTRY)
        self._renew_lease = redis.register_script(_RENEW_LEASE)

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float = DEFAULT_TTL_S,
                 lease_s: float = LEASE_S) -> RedisResponseStore:
        """Connects lazily (on first use) to the Redis at `url`."""
        from redis.asyncio import Redis

        # The session store's timeouts: a Redis that stopped answering costs a request two
        # seconds, not its whole deadline.
        return cls(Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0),
                   ttl_s=ttl_s, lease_s=lease_s)

    @property
    def redis(self) -> Redis:
        """Its client, which the gateway's conversation store shares."""
        return self._redis

    @classmethod
    def redis_key(cls, response_id: str) -> str:
        return f"{cls.KEY_PREFIX}{response_id}"

    async def put(self, record: StoredResponse, *, unless_stopped: bool = False) -> bool:
        def write() -> Awaitable[Any]:
            return self._put(
                keys=[self.redis_key(record.id), self._stop_key(record.id), self._lease_key(record.id)],
                args=[record.encode(), self._ttl_ms, int(unless_stopped),
                      self._lease_ms if record.is_running else 0])

        return bool(await (self._retried(write) if unless_stopped else self._call(write())))

    async def get(self, response_id: str) -> StoredResponse | None:
        text, lease = await self._call(self._redis.mget(self.redis_key(response_id),
                                                        self._lease_key(response_id)))
        if text is None:
            return None
        try:
            record = StoredResponse.decode(text)
        except (ValueError, TypeError, KeyError):
            logger.warning("stored response %s is not one this gateway wrote; ignored", response_id)
            return None
        return record.lapsed() if record.is_running and lease is None else record

    async def delete(self, response_id: str) -> bool:
        await self._call(self._redis.delete(self._events_key(response_id)))
        return bool(await self._call(self._redis.delete(self.redis_key(response_id))))

    async def request_stop(self, response_id: str, reason: StopReason) -> None:
        await self._call(self._redis.set(self._stop_key(response_id), reason, px=self._ttl_ms))

    async def renew_lease(self, response_id: str) -> GeneratorStop | None:
        stop = await self._call(self._renew_lease(
            keys=[self._stop_key(response_id), self._lease_key(response_id)], args=[self._lease_ms]))
        return next((reason for reason in (*STOP_REASONS, "lease_lapsed") if stop == reason.encode()),
                    None)

    async def append_event(self, response_id: str, number: int, event: str, *,
                           unless_stopped: bool = False) -> bool:
        return await self._add_entry(response_id, number, "event", event, unless_stopped)

    async def end_events(self, response_id: str, number: int, *,
                         unless_stopped: bool = False) -> None:
        await self._add_entry(response_id, number, "end", "1", unless_stopped)

    async def has_events(self, response_id: str) -> bool:
        return bool(await self._call(self._redis.exists(self._events_key(response_id))))

    async def events_after(self, response_id: str, number: int) -> AsyncGenerator[str, None]:
        key = self._events_key(response_id)
        last_id = f"{number + 1}-0"
        wait_ms: int | None = None  # the first read does not wait: the stream may have ended

        async def next_entries(block_ms: int | None) -> Any:
            return await self._retried(lambda: self._redis.xread({key: last_id}, count=256,
                                                                 block=block_ms))

        while True:
            read = await next_entries(wait_ms)
            wait_ms = self.EVENTS_WAIT_MS
            if not read:
                last = await self._retried(lambda: self._redis.xrevrange(key, count=1))
                if not last or b"end" in last[0][1]:
                    return  # ended before `number`, or deleted with its response, or expired
                if await self._retried(lambda: self._redis.exists(self._lease_key(response_id))):
                    continue
                # Its last events may have come as the lease lapsed, after it ended.
                read = await next_entries(None)
                if not read:
                    raise BackgroundResponseLostError(response_id, _entry_number(last[0][0]))
            for entry_id, entry in read[0][1]:
                if b"end" in entry:
                    return
                yield entry[b"event"].decode()
                last_id = entry_id

    async def _add_entry(self, response_id: str, number: int, name: str, value: str,
                         unless_stopped: bool) -> bool:
        def write() -> Awaitable[Any]:
            return self._add_entry_script(
                keys=[self._events_key(response_id), self._stop_key(response_id),
                      self._lease_key(response_id)],
                args=[f"{number + 1}-0", name, value, self._ttl_ms, int(unless_stopped)])

        return bool(await (self._retried(write) if unless_stopped else self._call(write())))

    def _events_key(self, response_id: str) -> str:
        return f"{self.EVENTS_KEY_PREFIX}{response_id}"

    def _stop_key(self, response_id: str) -> str:
        return f"{self.STOP_KEY_PREFIX}{response_id}"

    def _lease_key(self, response_id: str) -> str:
        return f"{self.LEASE_KEY_PREFIX}{response_id}"

    async def _call(self, pending: Any) -> Any:
        return await redis_call(pending, "response store")

    async def _retried(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """A background response's own call (its generator's writes, its stream's reads), made
        again through a blip that would otherwise fail a response its lease still holds."""
        return await redis_call_retried(call, "response store", retry_s=self.RETRY_S)

    async def aclose(self) -> None:
        await self._redis.aclose()


def _entry_number(entry_id: bytes) -> int:
    """The events a stream holds up to this entry: entry `n+1-0` holds event `n`."""
    return int(entry_id.split(b"-")[0])


async def conversation_before(store: ResponseStore, response_id: str) -> list[dict[str, Any]]:
    """The input and output items of the conversation up to `response_id`, oldest first."""
    record = await store.get(response_id)
    if record is None:
        raise PreviousResponseNotFoundError(
            f"previous_response_id: response {response_id!r} is not stored here (responses are "
            "kept for the gateway's --response-ttl-s, and not at all with store: false)",
            param="previous_response_id")
    if record.is_running:
        # Its output is not there yet: the conversation would go on without it.
        raise InvalidRequestError(f"previous_response_id: response {response_id!r} is still "
                                  f"{record.response['status']}; continue it once it has ended",
                                  param="previous_response_id")
    return [*record.input_items, *record.response["output"]]
