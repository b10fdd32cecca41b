"""The engine's own KV cache events, collected for routers: blocks held now, and each change.

vLLM's engine core publishes `KVEventBatch`es on a ZMQ PUB socket (`kv_events_config`, see
`services.engine.kv_transfer`). The engine service subscribes to it, keeps the block
hashes held per medium, and hands every batch to the gRPC watchers
(`EngineServicer.WatchKvEvents`), so a router needs one gRPC stream per engine and no ZMQ.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
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

    FELL_BEHIND = "the watcher fell behind the engine's KV events"
    EVENTS_LOST = "the engine service lost some of vLLM's KV events"
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
    """Subscribes to the engine's KV-event publisher; tracks held blocks; fans batches out.

    vLLM does not de-duplicate cached blocks: a hash may name several blocks (a prompt cached
    whole has its last block recomputed into a second one), each stored and removed with its
    own event, so a hash is held while it names at least one block. When batches go missing
    (the sequence numbers skip, or start over with a new publisher) the blocks held are
    forgotten: any hash reported after that is held, though a block stored before the loss
    is only reported once stored again.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        # How many blocks each hash names, per medium; only counts above zero are kept.
        self.held: dict[str, Counter[int]] = {}
        self._watchers: set[KvEventWatcher] = set()
        self._next_sequence = 0
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
                _topic, sequence_bytes, payload = await socket.recv_multipart()
                sequence = int.from_bytes(sequence_bytes, "big")
                try:
                    batch = self._decoder.decode(payload)
                except msgspec.DecodeError as error:
                    # Say, an event type of a newer vLLM. Collection goes on; the batch counts
                    # as lost when the next one's sequence number skips it.
                    logger.warning("could not read KV event batch %d: %s", sequence, error)
                    continue
                self.apply(sequence, batch)
        finally:
            socket.close(linger=0)

    def apply(self, sequence: int, batch: KVEventBatch) -> None:
        """Applies the publisher's batch number `sequence` and hands it to the watchers."""
        if sequence != self._next_sequence:
            # The SUB socket drops what overflows its queue, and vLLM's publisher counts from 0
            # again when it restarts; the engine's replay socket is not configured.
            logger.warning("expected KV event batch %d, got %d: events were lost; forgetting "
                           "the blocks held and ending the watches", self._next_sequence, sequence)
            self.held.clear()
            self._end_watches(WatchEnded.EVENTS_LOST)
        self._next_sequence = sequence + 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.held.setdefault(event.medium or "", Counter()).update(
                    block_hash_u64(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held = self.held.get(event.medium or "", Counter())
                for block_hash in map(block_hash_u64, event.block_hashes):
                    # No count is left for a block stored before events were lost.
                    if held[block_hash] > 1:
                        held[block_hash] -= 1
                    else:
                        held.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                # Only vLLM's own block pool resets its prefix cache; it names no medium.
                self.held.pop(MEDIUM_GPU, None)
        for watcher in list(self._watchers):
            if not watcher.offer(batch):
                self._watchers.discard(watcher)

    def end_watches(self) -> None:
        """Ends every open watch, so a draining gRPC server does not wait on endless streams."""
        self._end_watches(WatchEnded.ENGINE_STOPPING)

    def _end_watches(self, reason: WatchEnded) -> None:
        for watcher in self._watchers:
            watcher.batches.put_nowait(reason)
        self._watchers.clear()

    @contextmanager
    def watch(self) -> Iterator[tuple[dict[str, list[int]], KvEventWatcher]]:
        """The blocks held now and a watcher of every later batch, with nothing in between."""
        snapshot = {medium: sorted(counts) for medium, counts in self.held.items() if counts}
        watcher = KvEventWatcher()
        self._watchers.add(watcher)
        try:
            yield snapshot, watcher
        finally:
            self._watchers.discard(watcher)
