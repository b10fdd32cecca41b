"""`KvEventCollector` over a real ZMQ socket, fed vLLM's own event classes as vLLM's publisher
sends them: (topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import (MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored,
                                        KVEventBatch)

from backport.v1 import engine_pb2 as pb
from backport.v1 import engine_pb2_grpc
from services.engine.kv_events import KvEventCollector, WatchEnded
from services.engine.kv_transfer import KV_EVENTS_TOPIC
from services.engine.metrics import EngineMetrics
from services.engine.servicer import EngineServicer
from services.engine.settings import EngineSettings
from services.engine.vllm_engine import VllmEngine

TIMEOUT_S = 10.0
BLOCK_HASH = 0x1234_5678_9ABC_DEF0
OTHER_BLOCK_HASH = 0x0FED_CBA9_8765_4321


class Publisher:
    """What vLLM's `ZmqEventPublisher` sends, with the sequence numbers in the test's hands."""

    def __init__(self, endpoint: str) -> None:
        # XPUB: a PUB socket that also reads subscriptions, so nothing is sent before the
        # collector listens.
        self.socket = zmq.asyncio.Context.instance().socket(zmq.XPUB)
        self.socket.bind(endpoint)
        self.encoder = msgspec.msgpack.Encoder()

    async def wait_for_subscriber(self) -> None:
        subscription = await asyncio.wait_for(self.socket.recv(), TIMEOUT_S)
        assert subscription == b"\x01" + KV_EVENTS_TOPIC.encode()

    async def send(self, sequence: int, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        batch = KVEventBatch(ts=0.0, events=list(events))
        await self.send_payload(sequence, self.encoder.encode(batch))

    async def send_payload(self, sequence: int, payload: bytes) -> None:
        await self.socket.send_multipart((KV_EVENTS_TOPIC.encode(), sequence.to_bytes(8, "big"),
                                          payload))


def stored(*block_hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(block_hashes), parent_block_hash=None,
                       token_ids=[7] * 128 * len(block_hashes), block_size=128, lora_id=None,
                       medium=MEDIUM_GPU, lora_name=None)


def removed(*block_hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(block_hashes), medium=MEDIUM_GPU)


def held(collector: KvEventCollector) -> set[int]:
    with collector.watch() as (snapshot, _watcher):
        return set(snapshot.get(MEDIUM_GPU, []))


@asynccontextmanager
async def wired(tmp_path: Path) -> AsyncIterator[tuple[Publisher, KvEventCollector]]:
    """A publisher and a collector that has subscribed to it."""
    endpoint = f"ipc://{tmp_path / 'events'}"
    publisher = Publisher(endpoint)
    collector = KvEventCollector(endpoint)
    collection = asyncio.create_task(collector.run())
    try:
        await publisher.wait_for_subscriber()
        yield publisher, collector
    finally:
        collection.cancel()
        publisher.socket.close(linger=0)


async def applied(collector: KvEventCollector, publisher: Publisher, sequence: int,
                  *events: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
    """Sends one batch and waits until the collector has applied it."""
    with collector.watch() as (_snapshot, watcher):
        await publisher.send(sequence, *events)
        assert isinstance(await asyncio.wait_for(watcher.batches.get(), TIMEOUT_S), KVEventBatch)


def run_wired(tmp_path: Path,
              scenario: Callable[[Publisher, KvEventCollector], Awaitable[None]]) -> None:
    async def run() -> None:
        async with wired(tmp_path) as (publisher, collector):
            await scenario(publisher, collector)

    asyncio.run(run())


def test_a_hash_stays_held_while_any_of_its_blocks_is(tmp_path: Path) -> None:
    """vLLM caches a recomputed block beside the first copy under the same hash (two
    `BlockStored`), and removes each copy on its own eviction (one `BlockRemoved` each)."""
    run_wired(tmp_path, a_hash_stays_held_while_any_of_its_blocks_is)


async def a_hash_stays_held_while_any_of_its_blocks_is(publisher: Publisher,
                                                      collector: KvEventCollector) -> None:
    await applied(collector, publisher, 0, stored(BLOCK_HASH))
    await applied(collector, publisher, 1, stored(BLOCK_HASH))
    await applied(collector, publisher, 2, removed(BLOCK_HASH))
    assert held(collector) == {BLOCK_HASH}
    await applied(collector, publisher, 3, removed(BLOCK_HASH))
    assert held(collector) == set()
    # A removal of a block it never saw stored leaves nothing owed: the next store is held.
    await applied(collector, publisher, 4, removed(BLOCK_HASH))
    await applied(collector, publisher, 5, stored(BLOCK_HASH))
    assert held(collector) == {BLOCK_HASH}


@pytest.mark.parametrize("next_sequence", [2, 0], ids=["batch lost", "publisher restarted"])
def test_lost_batches_forget_the_held_blocks_and_end_the_watches(tmp_path: Path,
                                                                 next_sequence: int) -> None:
    """Batch 1 (say, the removal of BLOCK_HASH) never arrives: what the collector held may be
    gone, so it forgets it rather than report it forever, and each watcher, whose view is just
    as stale, is ended to take a new snapshot."""

    async def scenario(publisher: Publisher, collector: KvEventCollector) -> None:
        await lost_batches_forget_the_held_blocks(publisher, collector, next_sequence)

    run_wired(tmp_path, scenario)


async def lost_batches_forget_the_held_blocks(publisher: Publisher, collector: KvEventCollector,
                                              next_sequence: int) -> None:
    await applied(collector, publisher, 0, stored(BLOCK_HASH))
    with collector.watch() as (snapshot, watcher):
        assert snapshot == {MEDIUM_GPU: [BLOCK_HASH]}
        await publisher.send(next_sequence, stored(OTHER_BLOCK_HASH))
        assert await asyncio.wait_for(watcher.batches.get(), TIMEOUT_S) is WatchEnded.EVENTS_LOST
    assert held(collector) == {OTHER_BLOCK_HASH}
    # The numbering goes on from the batch after the gap.
    await applied(collector, publisher, next_sequence + 1, removed(OTHER_BLOCK_HASH))
    assert held(collector) == set()


def test_a_batch_it_cannot_read_counts_as_lost_and_collection_goes_on(tmp_path: Path) -> None:
    """Collection had ended at the first batch msgspec could not decode, silently: every later
    event was lost and watchers waited for batches that never came."""

    async def scenario(publisher: Publisher, collector: KvEventCollector) -> None:
        await applied(collector, publisher, 0, stored(BLOCK_HASH))
        with collector.watch() as (_snapshot, watcher):
            await publisher.send_payload(1, msgspec.msgpack.encode([0.0, [["NewEventType"]]]))
            await publisher.send(2, stored(OTHER_BLOCK_HASH))
            assert await asyncio.wait_for(watcher.batches.get(), TIMEOUT_S) is WatchEnded.EVENTS_LOST
        assert held(collector) == {OTHER_BLOCK_HASH}

    run_wired(tmp_path, scenario)


def test_a_grpc_watcher_is_told_to_call_again_after_lost_batches(tmp_path: Path) -> None:
    run_wired(tmp_path, grpc_watcher_is_told_to_call_again)


async def grpc_watcher_is_told_to_call_again(publisher: Publisher,
                                             collector: KvEventCollector) -> None:
    server = grpc.aio.server()
    servicer = EngineServicer(VllmEngine(EngineSettings(model="unused")), EngineMetrics(), collector)
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = engine_pb2_grpc.EngineStub(channel).WatchKvEvents(pb.WatchKvEventsRequest())
            assert (await asyncio.wait_for(call.read(), TIMEOUT_S)).WhichOneof("update") == "snapshot"
            await publisher.send(0, stored(BLOCK_HASH))
            assert (await asyncio.wait_for(call.read(), TIMEOUT_S)).WhichOneof("update") == "batch"
            await publisher.send(2, stored(OTHER_BLOCK_HASH))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(call.read(), TIMEOUT_S)
            assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "call again" in (ended.value.details() or "")
    finally:
        await server.stop(None)
