"""The engine's own KV cache events, collected for routers: blocks held now, and each change.

vLLM's engine core publishes `KVEventBatch`es on a ZMQ PUB socket (`kv_events_config`, see
`services.engine.kv_transfer`). The engine service subscribes to it, keeps the set of
block hashes held per medium, and hands every batch to the gRPC watchers
(`EngineServicer.WatchKvEvents`), so a router needs one gRPC stream per engine and no ZMQ.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from services.engine.kv_transfer import KV_EVENTS_TOPIC

logger = logging.getLogger(__name__)

# Batches a watcher may have unread before it is dropped; it then re-syncs from a snapshot.
MAX_UNREAD_BATCHES = 1024
BLOCK_HASH_BITS = 64
IPC_SCHEME = "ipc://"


def block_hash_u64(block_hash: bytes | int) -> int:
    """vLLM's hash as 64 bits: ints are already (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its
    default); bytes are reduced exactly as vLLM reduces them, so both settings agree."""
    if isinstance(block_hash, bytes):
        block_hash = int.from_bytes(block_hash, byteorder="big")
    return block_hash & ((1 << BLOCK_HASH_BITS) - 1)


def ipc_socket_path(endpoint: str) -> Path | None:
    """The socket file of an `ipc://PATH` endpoint; None for other transports."""
    return Path(endpoint.removeprefix(IPC_SCHEME)) if endpoint.startswith(IPC_SCHEME) else None


def subscriber_endpoint(publisher_endpoint: str) -> str | None:
    """Where to connect for vLLM's publisher at `publisher_endpoint`, or None.

    vLLM binds wildcard TCP and IPC endpoints, which this process can reach on the same
    host; any other TCP endpoint means vLLM connects out to someone else's socket.
    """
    if publisher_endpoint.startswith(IPC_SCHEME):
        return publisher_endpoint
    if publisher_endpoint.startswith("tcp://*:"):
        return "tcp://127.0.0.1:" + publisher_endpoint.removeprefix("tcp://*:")
    return None


class WatchEnded(Enum):
    """Why a watcher gets no more batches; the last item of its queue."""

    FELL_BEHIND = "fell behind"
    ENGINE_STOPPING = "engine stopping"


@dataclass(slots=True, eq=False)  # compared and hashed by identity: kept in a set
class KvEventWatcher:
    """One gRPC stream's batches not yet sent, then, once it is over, why."""

    batches: asyncio.Queue[KVEventBatch | WatchEnded] = field(
        default_factory=lambda: asyncio.Queue(MAX_UNREAD_BATCHES + 1))

    def offer(self, batch: KVEventBatch) -> bool:
        """Queues `batch`; False, and the watch ends, when MAX_UNREAD_BATCHES are unread."""
        if self.batches.qsize() < MAX_UNREAD_BATCHES:
            self.batches.put_nowait(batch)
            return True
        self.batches.put_nowait(WatchEnded.FELL_BEHIND)
        return False


def collector_for(publisher_endpoint: str | None) -> KvEventCollector | None:
    """The collector of the events vLLM publishes at `publisher_endpoint`, when it can reach them."""
    if publisher_endpoint is None:
        return None
    endpoint = subscriber_endpoint(publisher_endpoint)
    if endpoint is None:
        logger.warning("KV events go out to %s; WatchKvEvents stays off (it needs tcp://*:PORT "
                       "or ipc://PATH, which vLLM binds here)", publisher_endpoint)
        return None
    return KvEventCollector(endpoint)


class KvEventCollector:
    """Subscribes to the engine's KV-event publisher; tracks held blocks; fans batches out."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.held: dict[str, set[int]] = {}
        self._watchers: set[KvEventWatcher] = set()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)

    async def run(self) -> None:
        """Receives until cancelled. The SUB socket may connect before vLLM binds: ZMQ retries."""
        context = zmq.asyncio.Context.instance()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
        socket.connect(self.endpoint)
        logger.info("collecting KV events from %s", self.endpoint)
        try:
            while True:
                # (topic, sequence number, msgpack batch); see vllm.distributed.kv_events.
                _topic, _sequence, payload = await socket.recv_multipart()
                self.apply(self._decoder.decode(payload))
        finally:
            socket.close(linger=0)

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.held.setdefault(event.medium or "", set()).update(
                    block_hash_u64(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.held.get(event.medium or "", set()).difference_update(
                    block_hash_u64(h) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                # Only vLLM's own block pool resets its prefix cache; it names no medium.
                self.held.pop(MEDIUM_GPU, None)
        for watcher in list(self._watchers):
            if not watcher.offer(batch):
                self._watchers.discard(watcher)

    def end_watches(self) -> None:
        """Ends every open watch, so a draining gRPC server does not wait on endless streams."""
        for watcher in self._watchers:
            watcher.batches.put_nowait(WatchEnded.ENGINE_STOPPING)
        self._watchers.clear()

    @contextmanager
    def watch(self) -> Iterator[tuple[dict[str, list[int]], KvEventWatcher]]:
        """The blocks held now and a watcher of every later batch, with nothing in between."""
        snapshot = {medium: sorted(hashes) for medium, hashes in self.held.items() if hashes}
        watcher = KvEventWatcher()
        self._watchers.add(watcher)
        try:
            yield snapshot, watcher
        finally:
            self._watchers.discard(watcher)
