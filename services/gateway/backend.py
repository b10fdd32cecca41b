"""What the gateway talks to: the tokenizer service, the engines, and the model they serve."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from backport.v1 import engine_pb2 as pb
from backport.v1 import tokenizer_pb2

from services.gateway.background_responses import BackgroundResponses
from services.gateway.conversation_store import (ConversationStore, InMemoryConversationStore,
                                                 RedisConversationStore)
from services.gateway.dispatch import EngineRoute
from services.gateway.engine_pool import EnginePool
from services.gateway.engine_registry import RegistryWatcher
from services.gateway.errors import ServiceUnavailableError
from services.gateway.metrics import GatewayMetrics
from services.gateway.parsing.registry import reasoning_format
from services.gateway.reasoning_effort import (InMemorySessionEffortStore, RedisSessionEffortStore,
                                                SessionEffortStore, session_key)
from services.gateway.reasoning_tokens import ReasoningMarkerIds
from services.gateway.request_context import current_request_context
from services.gateway.response_store import InMemoryResponseStore, RedisResponseStore, ResponseStore
from services.gateway.routing import Router
from services.gateway.settings import DEFAULT_ENGINE, GatewaySettings
from services.tokenizer.client import TokenizerClient

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 600.0
# Each describe call's deadline, tokenizer's or engine's; a slow one is asked again.
MODEL_INFO_TIMEOUT_S = 5.0
MESH_WAIT_POLL_S = 0.5
# A service not listening yet (still loading), or slow to answer: worth asking again.
NOT_YET_UP_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    max_model_len: int
    chat_format: str
    architecture: str
    vocab_size: int
    # Set where a reasoning parser is on and its markers are one token each.
    reasoning_markers: ReasoningMarkerIds | None = None
    # What a request that leaves them unset samples with: the model's defaults, else vLLM's.
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    # When this gateway found the model served: `/v1/models` lists it as created then.
    created: int = field(default_factory=lambda: int(time.time()))


class GatewayBackend:
    """Connections to the mesh, created in the app's lifespan."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.tokenizer = TokenizerClient(settings.tokenizer, timeout_s=settings.tokenizer_timeout_s)
        self.pool = EnginePool(settings)
        static_engines = settings.engine or ([] if settings.redis_url else [DEFAULT_ENGINE])
        for address in static_engines:
            self.pool.add(address, is_static=True)
        self.router = Router(settings.routing_policy, block_tokens=settings.prefix_block_tokens,
                             affinity_max_tokens=settings.prefix_affinity_tokens,
                             load_bound=settings.load_bound, load_slack=settings.load_slack)
        self.registry = (RegistryWatcher(settings.redis_url, self.pool, metrics,
                                         settings.registry_poll_s) if settings.redis_url else None)
        self._redis_effort_store = (RedisSessionEffortStore.from_url(settings.redis_url)
                                    if settings.redis_url else None)
        self.effort_store: SessionEffortStore = (self._redis_effort_store
                                                 or InMemorySessionEffortStore())
        self.response_store: ResponseStore
        self.conversation_store: ConversationStore
        if settings.redis_url:
            response_store = RedisResponseStore.from_url(settings.redis_url, ttl_s=settings.response_ttl_s)
            self.response_store = response_store
            self.conversation_store = RedisConversationStore(response_store.redis,
                                                             ttl_s=settings.response_ttl_s)
        else:
            self.response_store = InMemoryResponseStore(ttl_s=settings.response_ttl_s)
            self.conversation_store = InMemoryConversationStore(ttl_s=settings.response_ttl_s)
        self.background_responses = BackgroundResponses(self.response_store)
        self.model: ServedModel | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._connecting: asyncio.Task[None] | None = None
        self._is_connect_stopped = False

    async def connect(self) -> None:
        """Waits for the tokenizer and for an engine to describe the model; returns with no
        model once `stop_connecting` is called."""
        if self._is_connect_stopped:
            return
        self._connecting = asyncio.ensure_future(self._wait_for_mesh())
        try:
            await self._connecting
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not self._is_connect_stopped or (current is not None and current.cancelling()):
                raise
            logger.info("stopped while waiting for the mesh")
        finally:
            self._connecting = None

    def stop_connecting(self) -> None:
        """Ends the wait of `connect` (a signal during startup): it may last minutes, while
        engines load, and the server looks at signals only once the app has started."""
        self._is_connect_stopped = True
        if self._connecting is not None:
            self._connecting.cancel()

    async def _wait_for_mesh(self) -> None:
        tokenizer_info = await self._tokenizer_info()
        if self.registry is not None:
            self._tasks.append(asyncio.create_task(self.registry.run()))
        model_info = await self._first_model_info()
        self.pool.model_name = model_info.served_model_name
        reasoning_parser = self.settings.reasoning_parser
        self.model = ServedModel(
            name=self.settings.served_model_name or model_info.served_model_name,
            max_model_len=model_info.max_model_len, chat_format=tokenizer_info.chat_format,
            architecture=model_info.architecture, vocab_size=model_info.vocab_size,
            **{name: getattr(model_info, name) for name in ("default_temperature", "default_top_p")
               if model_info.HasField(name)},
            reasoning_markers=(await ReasoningMarkerIds.of(reasoning_format(reasoning_parser),
                                                           self.tokenizer)
                               if reasoning_parser else None))
        await self.pool.probe_health()
        self._tasks.append(asyncio.create_task(self.pool.run_health_checks()))
        logger.info("serving %s (%s, context %d, chat format %s, routing %s) on %d engine(s)",
                    self.model.name, self.model.architecture, self.model.max_model_len,
                    self.model.chat_format, self.settings.routing_policy, len(self.pool.engines))

    async def _tokenizer_info(self) -> tokenizer_pb2.TokenizerInfo:
        """The tokenizer service's answer, waited for: started beside the gateway (compose), it
        listens only once its tokenizer has loaded."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                return await self.tokenizer.info(timeout_s=MODEL_INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                if error.code() not in NOT_YET_UP_CODES or time.monotonic() >= deadline:
                    raise
                logger.info("waiting for the tokenizer service %s: %s", self.tokenizer.address,
                            error.code().name)
            await asyncio.sleep(MESH_WAIT_POLL_S)

    async def _first_model_info(self) -> pb.ModelInfo:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while time.monotonic() < deadline:
            for engine in list(self.pool.engines.values()):
                if self.pool.engines.get(engine.address) is not engine:
                    continue  # left the registry during an earlier call; its channel is closed
                try:
                    return await engine.client.model_info(timeout_s=MODEL_INFO_TIMEOUT_S)
                except grpc.aio.AioRpcError as error:
                    logger.info("waiting for engine %s: %s", engine.address, error.code().name)
                except asyncio.CancelledError:
                    # The pool closed the channel under the call (the engine left the
                    # registry); only a cancellation of this task itself ends the wait.
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise
                    logger.info("waiting for engines: %s left the registry", engine.address)
            await asyncio.sleep(MESH_WAIT_POLL_S)
        raise TimeoutError(f"no engine answered within {CONNECT_TIMEOUT_S} s")

    def served_model(self) -> ServedModel:
        if self.model is None:
            raise ServiceUnavailableError("the gateway is still connecting to the mesh")
        return self.model

    def pick_engine(self, *, prompt_cache_key: str | None = None,
                    user: str | None = None) -> EngineRoute:
        """The route of one engine request; the engine is chosen when the prompt is sent.
        Session affinity follows the session key, as sticky effort does: the `X-Session-Id`
        header, else `prompt_cache_key`, else `user` (`docs/routing.md`)."""
        session = session_key(session_id=current_request_context().session_id,
                              prompt_cache_key=prompt_cache_key, user=user)
        return EngineRoute(self.pool, self.router, self.metrics, self.settings, session)

    async def close(self) -> None:
        # First: what they store as they stop goes through the store, closed below.
        await self.background_responses.aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(self.tokenizer.close(), self.pool.close())
        if self.registry is not None:
            await self.registry.close()
        if self._redis_effort_store is not None:
            await self._redis_effort_store.aclose()
        await self.response_store.aclose()
