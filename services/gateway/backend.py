"""What the gateway talks to: the tokenizer service, the engines, and the model they serve."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.engine.client import EngineClient
from services.gateway.errors import ServiceUnavailableError
from services.gateway.reasoning_effort import (InMemorySessionEffortStore, RedisSessionEffortStore,
                                                SessionEffortStore)
from services.gateway.settings import GatewaySettings
from services.tokenizer.client import TokenizerClient

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    max_model_len: int
    chat_format: str
    architecture: str


class GatewayBackend:
    """Connections to the mesh, created in the app's lifespan."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.tokenizer = TokenizerClient(settings.tokenizer)
        self.engines = [EngineClient(address) for address in settings.engine]
        self._redis_effort_store = (RedisSessionEffortStore.from_url(settings.redis_url)
                                    if settings.redis_url else None)
        self.effort_store: SessionEffortStore = (self._redis_effort_store
                                                 or InMemorySessionEffortStore())
        self.model: ServedModel | None = None
        self._next_engine = 0

    async def connect(self) -> None:
        """Waits for the tokenizer and the first engine to describe the model."""
        tokenizer_info = await self.tokenizer.info(timeout_s=CONNECT_TIMEOUT_S)
        model_info = await self.engines[0].model_info(timeout_s=CONNECT_TIMEOUT_S)
        self.model = ServedModel(
            name=self.settings.served_model_name or model_info.served_model_name,
            max_model_len=model_info.max_model_len, chat_format=tokenizer_info.chat_format,
            architecture=model_info.architecture)
        logger.info("serving %s (%s, context %d, chat format %s) on %d engine(s)", self.model.name,
                    self.model.architecture, self.model.max_model_len, self.model.chat_format,
                    len(self.engines))

    def served_model(self) -> ServedModel:
        if self.model is None:
            raise ServiceUnavailableError("the gateway is still connecting to the mesh")
        return self.model

    def pick_engine(self) -> EngineClient:
        engine = self.engines[self._next_engine % len(self.engines)]
        self._next_engine += 1
        return engine

    async def close(self) -> None:
        await asyncio.gather(self.tokenizer.close(), *(e.close() for e in self.engines))
        if self._redis_effort_store is not None:
            await self._redis_effort_store.aclose()
