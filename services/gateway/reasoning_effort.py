"""Reasoning-effort defaults of DeepSeek-V4-Flash-0731 and sticky effort per session.

Mapping (the same as vLLM's for this model): a request with no `thinking` and no
`reasoning_effort` thinks at high effort; `reasoning_effort: "none"` is plain chat;
low/minimal/medium -> low; max -> max; high/xhigh -> high. The keys may also come in
`chat_template_kwargs` (`thinking`, `enable_thinking`, `reasoning_effort`); a request-level
`reasoning_effort` wins over the kwargs one and, unless the kwargs set `enable_thinking`,
turns thinking on (off for "none"), as in vLLM.

Sticky effort: agentic clients often set an effort on a session's first request only; their
later turns would fall back to the default and the model drifts. Requests sharing a session key
(`X-Session-Id` header, else `prompt_cache_key`, else `user`) that carry no effort inherit the
effort of the session's first request. Pure Python: the gateway imports it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from redis.exceptions import RedisError

if TYPE_CHECKING:
    from redis.asyncio import Redis

logger = logging.getLogger(__name__)

EffortLevel = Literal["low", "high", "max"]
# What a request's `reasoning_effort` (chat) or `reasoning.effort` (Responses) may be: OpenAI's
# values and DeepSeek-V4's "max", the set vLLM's server accepts. Template kwargs stay free-form.
RequestedEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
_LEVELS: tuple[EffortLevel, ...] = ("low", "high", "max")
# Keys longer than this are stored by digest so a client cannot make the store hold huge keys.
MAX_RAW_SESSION_KEY_CHARS = 128


class EffortRequestError(ValueError):
    """A request's effort fields have the wrong type (HTTP 400); `field` names the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Effort:
    """Thinking on or off, and the effort level when on."""

    is_thinking: bool
    level: EffortLevel | None = None

    def template_kwargs(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The request's template kwargs with this effort written in, for the tokenizer service.

        Both `thinking` (DeepSeek-V4) and `enable_thinking` (GLM, Qwen templates) are set.
        """
        kwargs = dict(chat_template_kwargs or {})
        kwargs["thinking"] = self.is_thinking
        kwargs["enable_thinking"] = self.is_thinking
        kwargs["reasoning_effort"] = self.level if self.is_thinking else "none"
        return kwargs

    def encode(self) -> str:
        """`thinking:<level>` or `chat`: the stored form."""
        return f"thinking:{self.level}" if self.is_thinking else "chat"

    @classmethod
    def decode(cls, stored: str | bytes) -> Effort:
        """Inverse of `encode`; raises ValueError on anything else."""
        text = stored.decode() if isinstance(stored, bytes) else stored
        if text == "chat":
            return CHAT
        mode, _, level = text.partition(":")
        if mode != "thinking" or level not in _LEVELS:
            raise ValueError(f"not a stored effort: {text!r}")
        return cls(is_thinking=True, level=level)  # type: ignore[arg-type]


DEFAULT_EFFORT = Effort(is_thinking=True, level="high")
CHAT = Effort(is_thinking=False)


def effort_level(reasoning_effort: str | None) -> EffortLevel:
    """low/minimal/medium -> low, max -> max, anything else (unset, high, xhigh) -> high."""
    if reasoning_effort == "max":
        return "max"
    if reasoning_effort in ("low", "minimal", "medium"):
        return "low"
    return "high"


def requested_effort(
    *,
    reasoning_effort: str | None = None,
    thinking: bool | Mapping[str, Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Effort | None:
    """The effort a request asks for, or None when it carries no effort at all.

    `thinking` is the request-level field: a bool or DeepSeek's `{"type": "enabled"|"disabled"}`;
    it stands in for `chat_template_kwargs.thinking`.
    """
    kwargs = chat_template_kwargs or {}
    if reasoning_effort is not None and not isinstance(reasoning_effort, str):
        raise EffortRequestError("reasoning_effort", "must be a string")
    effort = reasoning_effort if reasoning_effort is not None else kwargs.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise EffortRequestError("chat_template_kwargs.reasoning_effort", "must be a string")
    flags: dict[str, bool] = {}
    if thinking is not None:
        flags["thinking"] = _thinking_flag(thinking)
    elif "thinking" in kwargs:
        flags["thinking"] = bool(kwargs["thinking"])
    if "enable_thinking" in kwargs:
        flags["enable_thinking"] = bool(kwargs["enable_thinking"])
    elif reasoning_effort is not None:
        flags["enable_thinking"] = reasoning_effort != "none"
    if effort is None and not flags:
        return None
    if effort == "none":
        return CHAT
    is_thinking = any(flags.values()) if flags else True
    return Effort(is_thinking=True, level=effort_level(effort)) if is_thinking else CHAT


def passthrough_template_kwargs(reasoning_effort: str | None,
                                chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Template kwargs for models rendered by their own jinja template (GLM, Qwen, ...).

    The DeepSeek mapping does not apply there; the request's effort goes through untouched, as
    vLLM passes it: `reasoning_effort` as given, and `enable_thinking` = effort != "none" unless
    the kwargs already set it.
    """
    kwargs = dict(chat_template_kwargs or {})
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
        kwargs.setdefault("enable_thinking", reasoning_effort != "none")
    return kwargs


def _thinking_flag(thinking: bool | Mapping[str, Any]) -> bool:
    if isinstance(thinking, bool):
        return thinking
    if isinstance(thinking, Mapping) and thinking.get("type") in ("enabled", "disabled"):
        return thinking["type"] == "enabled"
    raise EffortRequestError("thinking", 'must be a boolean or {"type": "enabled" | "disabled"}')


def session_key(*, session_id: str | None, prompt_cache_key: str | None, user: str | None) -> str | None:
    """The session a request belongs to: `X-Session-Id`, else `prompt_cache_key`, else `user`."""
    key = next((candidate for candidate in (session_id, prompt_cache_key, user) if candidate), None)
    if key is None or len(key) <= MAX_RAW_SESSION_KEY_CHARS:
        return key
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class SessionEffortStore(Protocol):
    """Remembers the effort of each session's first request."""

    async def remember_first(self, session_key: str, effort: Effort) -> Effort:
        """Records `effort` unless the session has one; returns the session's effort.

        Every call refreshes the session's lifetime.
        """
        ...


async def resolve_session_effort(requested: Effort | None, session: str | None,
                                 store: SessionEffortStore | None) -> Effort:
    """The effort to serve a request with: its own, else its session's first, else the default.

    A request with its own effort still records it when it opens the session.
    """
    if session is None or store is None:
        return requested or DEFAULT_EFFORT
    first = await store.remember_first(session, requested or DEFAULT_EFFORT)
    return requested or first


class InMemorySessionEffortStore:
    """One process's sessions, each kept `ttl_s` after its last use; the least recently used
    session goes first once `max_sessions` are held."""

    def __init__(self, *, ttl_s: float = 24 * 3600, max_sessions: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_sessions <= 0:
            raise ValueError("ttl_s and max_sessions must be positive")
        self._ttl_s = ttl_s
        self._max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, tuple[Effort, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    async def remember_first(self, session_key: str, effort: Effort) -> Effort:
        # No await inside: the read-modify-write cannot interleave with another request.
        now = self._clock()
        held = self._sessions.pop(session_key, None)
        if held is not None and held[1] > now:
            effort = held[0]
        self._sessions[session_key] = (effort, now + self._ttl_s)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        return effort


class RedisSessionEffortStore:
    """Sessions shared by every gateway replica, in Redis.

    Key `backport:session:<session key>:effort`, value `thinking:<low|high|max>` or `chat`
    (see `Effort.encode`). Lifetime: `ttl_s` (24 h by default) from the session's last request;
    every request of the session refreshes it, so an active session never loses its effort.
    """

    KEY_PREFIX = "backport:session:"
    KEY_SUFFIX = ":effort"

    def __init__(self, redis: Redis, *, ttl_s: int = 24 * 3600) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self._redis = redis
        self._ttl_s = ttl_s

    @classmethod
    def from_url(cls, url: str, *, ttl_s: int = 24 * 3600) -> RedisSessionEffortStore:
        """Connects lazily (on first use) to the Redis at `url`, e.g. `redis://host:6379/0`."""
        from redis.asyncio import Redis

        # Timeouts as the engine registry's: a Redis that stopped answering costs a request
        # two seconds, not its whole deadline.
        return cls(Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0),
                   ttl_s=ttl_s)

    @classmethod
    def redis_key(cls, session_key: str) -> str:
        return f"{cls.KEY_PREFIX}{session_key}{cls.KEY_SUFFIX}"

    async def remember_first(self, session_key: str, effort: Effort) -> Effort:
        key = self.redis_key(session_key)
        try:
            # One MULTI/EXEC: concurrent first requests of a session agree on a single winner.
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(key, effort.encode(), nx=True, ex=self._ttl_s)
                pipe.getex(key, ex=self._ttl_s)
                _, held = await pipe.execute()
            try:
                return Effort.decode(held) if held is not None else effort
            except ValueError:
                # Not ours to trust (written by something else): start the session afresh.
                await self._redis.set(key, effort.encode(), ex=self._ttl_s)
                return effort
        except RedisError as error:
            # Serving the request at its own (or the default) effort beats failing it while
            # Redis is away; routing rides out the same outage (docs/routing.md).
            logger.warning("session effort store unavailable (%s); serving %s without it",
                           error, effort.encode())
            return effort

    async def aclose(self) -> None:
        await self._redis.aclose()
