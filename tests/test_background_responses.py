"""`BackgroundResponses`, alone: a generation runs to its end unless stopped here, on another
replica (seen through the shared store), by the gateway stopping, or by its lease lapsing; each
early end is recorded once the generation is gone. The mesh's own tests are in
tests/test_responses_store.py and tests/cluster/test_gateway_sessions_and_signals.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from services.gateway.background_responses import BackgroundResponses, EarlyEnd
from services.gateway.errors import ServiceUnavailableError
from services.gateway.response_store import (LAPSED_MESSAGE, BackgroundResponseLostError,
                                             InMemoryResponseStore, RedisResponseStore, StoredResponse)
from services.gateway.routes.responses import _stored_stream

POLL_S = 0.02


class CountingWork:
    """A generation of `steps` steps, counted; the engine's part is what the mesh tests run."""

    def __init__(self, steps: int = 1000) -> None:
        self.steps = steps
        self.made = 0
        self.was_cancelled = False
        self.ends: list[EarlyEnd] = []
        self.made_when_ended: int | None = None

    async def generate(self) -> None:
        try:
            for _ in range(self.steps):
                await asyncio.sleep(POLL_S / 4)
                self.made += 1
        except asyncio.CancelledError:
            self.was_cancelled = True
            raise

    async def stopped(self, end: EarlyEnd) -> None:
        self.made_when_ended = self.made
        self.ends.append(end)


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(POLL_S / 4)


async def _stored(store: InMemoryResponseStore | RedisResponseStore, response_id: str) -> None:
    await store.put(StoredResponse({"id": response_id, "status": "queued", "output": []}, []))


def test_a_generation_runs_to_its_end_and_records_no_early_end() -> None:
    async def scenario() -> CountingWork:
        store = InMemoryResponseStore()
        background = BackgroundResponses(store, stop_poll_s=POLL_S)
        generation = CountingWork(steps=10)
        background.start("resp_a", generation.generate(), generation.stopped)
        assert background.num_running == 1
        await _until(lambda: background.num_running == 0)
        return generation

    generation = asyncio.run(scenario())
    assert (generation.made, generation.was_cancelled, generation.ends) == (10, False, [])


@pytest.mark.parametrize("reason", ["cancelled", "deleted"])
def test_a_stop_here_ends_the_generation_before_recording_it(reason: EarlyEnd) -> None:
    async def scenario() -> CountingWork:
        store = InMemoryResponseStore()
        await _stored(store, "resp_a")
        background = BackgroundResponses(store, stop_poll_s=60)  # no poll: the stop is direct
        generation = CountingWork()
        background.start("resp_a", generation.generate(), generation.stopped)
        await _until(lambda: generation.made > 2)
        await background.stop("resp_a", reason)  # type: ignore[arg-type]
        await _until(lambda: background.num_running == 0)
        return generation

    generation = asyncio.run(scenario())
    assert generation.was_cancelled and generation.ends == [reason]
    assert generation.made_when_ended == generation.made < 1000


def test_a_stop_on_another_replica_reaches_the_generation_through_the_store() -> None:
    async def scenario() -> CountingWork:
        store = InMemoryResponseStore()
        await _stored(store, "resp_a")
        running_here = BackgroundResponses(store, stop_poll_s=POLL_S)
        elsewhere = BackgroundResponses(store, stop_poll_s=POLL_S)
        generation = CountingWork()
        running_here.start("resp_a", generation.generate(), generation.stopped)
        await _until(lambda: generation.made > 2)
        await elsewhere.stop("resp_a", "cancelled")
        await _until(lambda: running_here.num_running == 0)
        return generation

    generation = asyncio.run(scenario())
    assert generation.was_cancelled and generation.ends == ["cancelled"]


def test_a_gateway_that_closes_stops_what_runs_and_records_why() -> None:
    async def scenario() -> list[CountingWork]:
        background = BackgroundResponses(InMemoryResponseStore(), stop_poll_s=60)
        generations = [CountingWork(), CountingWork()]
        for index, generation in enumerate(generations):
            background.start(f"resp_{index}", generation.generate(), generation.stopped)
        await _until(lambda: all(generation.made for generation in generations))
        await background.aclose()
        assert background.num_running == 0
        return generations

    for generation in asyncio.run(scenario()):
        assert generation.was_cancelled and generation.ends == ["gateway_stopped"]


def test_the_stores_keep_a_stop_past_the_response_deleted(redis_url: str) -> None:
    """A DELETE removes the response before its generator, on whichever replica, looks."""
    async def scenario(store: InMemoryResponseStore | RedisResponseStore) -> list[object]:
        try:
            await store.put(StoredResponse({"id": "resp_s", "status": "queued", "output": []}, []))
            seen: list[object] = [await store.renew_lease("resp_s")]
            await store.request_stop("resp_s", "deleted")
            await store.delete("resp_s")
            seen.append(await store.renew_lease("resp_s"))
            await store.request_stop("resp_s", "cancelled")
            seen.append(await store.renew_lease("resp_s"))
            return seen
        finally:
            await store.aclose()

    for store in (InMemoryResponseStore(), RedisResponseStore.from_url(redis_url)):
        assert asyncio.run(scenario(store)) == [None, "deleted", "cancelled"]


def test_the_stores_give_a_stream_s_events_after_any_number_as_they_come(redis_url: str) -> None:
    """A reader that came first waits for each event; one that came later starts after the
    number it names; a delete ends both."""
    async def scenario(store: InMemoryResponseStore | RedisResponseStore) -> list[object]:
        try:
            await store.put(StoredResponse({"id": "resp_e", "status": "queued", "output": []}, []))
            assert not await store.has_events("resp_e")
            await store.append_event("resp_e", 0, "zero")

            async def read(after: int, response_id: str = "resp_e") -> list[str]:
                return [event async for event in store.events_after(response_id, after)]

            from_the_start = asyncio.ensure_future(read(-1))
            await asyncio.sleep(POLL_S)
            await store.append_event("resp_e", 1, "one")
            await store.append_event("resp_e", 2, "two")
            await store.end_events("resp_e", 3)
            whole = [await from_the_start, await read(0), await read(2), await store.has_events("resp_e")]
            await store.append_event("resp_f", 0, "f-zero")
            waiting = asyncio.ensure_future(read(-1, "resp_f"))
            await asyncio.sleep(POLL_S)
            await store.delete("resp_f")
            whole.append(await asyncio.wait_for(waiting, 5))
            return whole
        finally:
            await store.aclose()

    for store in (InMemoryResponseStore(), RedisResponseStore.from_url(redis_url)):
        assert asyncio.run(scenario(store)) == [["zero", "one", "two"], ["one", "two"], [], True,
                                                ["f-zero"]]


def test_the_in_process_store_holds_at_most_its_characters_of_events() -> None:
    """A stream's events (each delta a whole event) outweigh its response: they count too."""
    store = InMemoryResponseStore(max_chars=250)

    async def held() -> list[bool]:
        for index in range(4):
            for number in range(2):
                await store.append_event(f"resp_{index}", number, "x" * 50)
        return [await store.has_events(f"resp_{index}") for index in range(4)]

    assert asyncio.run(held()) == [False, False, True, True]


def test_a_generation_that_ends_with_a_stop_pending_is_recorded_as_stopped() -> None:
    """Its last writes were refused by the store; its end must still be recorded."""
    async def scenario() -> CountingWork:
        store = InMemoryResponseStore()
        await _stored(store, "resp_a")
        running_here = BackgroundResponses(store, stop_poll_s=60)  # never polls before the end
        generation = CountingWork(steps=20)
        running_here.start("resp_a", generation.generate(), generation.stopped)
        await _until(lambda: generation.made > 2)
        await BackgroundResponses(store).stop("resp_a", "cancelled")  # another replica
        await _until(lambda: running_here.num_running == 0)
        return generation

    generation = asyncio.run(scenario())
    assert generation.made == 20 and generation.ends == ["cancelled"]


def test_a_stop_before_the_generation_s_first_step_still_records_its_end() -> None:
    async def scenario() -> CountingWork:
        background = BackgroundResponses(InMemoryResponseStore(), stop_poll_s=60)
        generation = CountingWork()
        background.start("resp_a", generation.generate(), generation.stopped)
        await background.stop("resp_a", "deleted")  # no step of the task has run yet
        await _until(lambda: background.num_running == 0)
        return generation

    assert asyncio.run(scenario()).ends == ["deleted"]


def test_the_stores_refuse_a_stopped_response_s_own_writes_but_not_its_end(redis_url: str) -> None:
    async def scenario(store: InMemoryResponseStore | RedisResponseStore) -> list[object]:
        record = StoredResponse({"id": "resp_w", "status": "in_progress", "output": []}, [])
        try:
            await _stored(store, "resp_w")
            seen: list[object] = [await store.put(record, unless_stopped=True),
                                  await store.append_event("resp_w", 0, "zero", unless_stopped=True)]
            await store.request_stop("resp_w", "cancelled")
            completed = StoredResponse({**record.response, "status": "completed"}, [])
            seen += [await store.put(completed, unless_stopped=True),
                     await store.append_event("resp_w", 1, "one", unless_stopped=True)]
            await store.end_events("resp_w", 1, unless_stopped=True)
            seen.append((await store.get("resp_w")).response["status"])
            cancelled = StoredResponse({**record.response, "status": "cancelled"}, [])
            seen += [await store.put(cancelled), await store.append_event("resp_w", 1, "last")]
            await store.end_events("resp_w", 2)
            seen.append([event async for event in store.events_after("resp_w", -1)])
            return seen
        finally:
            await store.aclose()

    for store in (InMemoryResponseStore(), RedisResponseStore.from_url(redis_url)):
        assert asyncio.run(scenario(store)) == [True, True, False, False, "in_progress", True, True,
                                                ["zero", "last"]]


LEASE_S = 0.3


def test_a_response_whose_lease_lapsed_reads_failed_and_refuses_its_generator(redis_url: str) -> None:
    """Its gateway is gone: readers get its end, and nothing it wrote late brings it back."""
    async def scenario() -> list[object]:
        store = RedisResponseStore.from_url(redis_url, lease_s=LEASE_S)
        in_progress = StoredResponse({"id": "resp_l", "status": "in_progress", "output": []}, [])
        try:
            await _stored(store, "resp_l")
            seen: list[object] = [await store.renew_lease("resp_l"),
                                  await store.put(in_progress, unless_stopped=True),
                                  await store.append_event("resp_l", 0, "zero", unless_stopped=True)]
            await asyncio.sleep(LEASE_S * 2)
            failed = (await store.get("resp_l")).response
            seen += [failed["status"], failed["error"]["message"] == LAPSED_MESSAGE,
                     await store.renew_lease("resp_l")]
            completed = StoredResponse({**in_progress.response, "status": "completed"}, [])
            seen += [await store.put(completed, unless_stopped=True),
                     await store.append_event("resp_l", 1, "one", unless_stopped=True)]
            read: list[str] = []
            with pytest.raises(BackgroundResponseLostError) as lost:
                async for event in store.events_after("resp_l", -1):
                    read.append(event)
            seen += [read, lost.value.num_events, (await store.get("resp_l")).response["status"]]
            return seen
        finally:
            await store.aclose()

    assert asyncio.run(scenario()) == [None, True, True, "failed", True, "lease_lapsed",
                                       False, False, ["zero"], 1, "failed"]


def test_a_stream_read_from_past_its_end_ends_at_once_while_its_lease_runs(redis_url: str) -> None:
    """Not after the lease, 10 s on, as a lost one."""
    async def scenario() -> list[list[str]]:
        store = RedisResponseStore.from_url(redis_url)
        try:
            await _stored(store, "resp_p")
            await store.append_event("resp_p", 0, "zero", unless_stopped=True)
            await store.end_events("resp_p", 1, unless_stopped=True)

            async def read(after: int) -> list[str]:
                return [event async for event in store.events_after("resp_p", after)]

            return [await asyncio.wait_for(read(after), 0.5) for after in (0, 5)]
        finally:
            await store.aclose()

    assert asyncio.run(scenario()) == [[], []]


@pytest.mark.parametrize(("stopped_as", "last_events"), [
    (None, [("error", None), ("response.failed", "failed")]),
    ("cancelled", [("response.incomplete", "cancelled")]),  # a cancel came as its lease ran out
])
def test_a_lost_stream_ends_as_its_response_now_reads(redis_url: str, stopped_as: str | None,
                                                      last_events: list[tuple[str, str | None]]) -> None:
    async def scenario() -> list[dict[str, Any]]:
        store = RedisResponseStore.from_url(redis_url, lease_s=LEASE_S)
        try:
            await _stored(store, "resp_q")
            await store.append_event("resp_q", 0, "event: response.created\ndata: {}\n\n",
                                     unless_stopped=True)
            if stopped_as is not None:
                await store.put(StoredResponse({"id": "resp_q", "status": stopped_as, "output": []}, []))
            await asyncio.sleep(LEASE_S * 2)
            events = [event async for event in _stored_stream(store, "resp_q", -1)]
            return [json.loads(event.split("data: ", 1)[1]) for event in events[1:]]
        finally:
            await store.aclose()

    ending = asyncio.run(scenario())
    assert [(event["type"], event.get("response", {}).get("status")) for event in ending] == last_events
    assert [event["sequence_number"] for event in ending] == list(range(1, len(ending) + 1))


def test_a_lost_stream_whose_response_cannot_be_read_ends_with_an_error_event(
        redis_url: str) -> None:
    """Its lease gone, the stream looks up how the response now reads; where Redis refuses that
    read (here a Redis user denied MGET), the stream ended with an exception, a connection cut
    mid-stream; it ends with an `error` event numbered on."""
    async def scenario() -> list[dict[str, Any]]:
        from redis.asyncio import Redis

        admin = Redis.from_url(redis_url)
        await admin.execute_command("ACL", "SETUSER", "no-mget", "on", ">pw", "~*", "&*", "+@all",
                                    "-mget")
        store = RedisResponseStore.from_url(redis_url.replace("redis://", "redis://no-mget:pw@"),
                                            lease_s=LEASE_S)
        try:
            await _stored(store, "resp_m")
            await store.append_event("resp_m", 0, "event: response.created\ndata: {}\n\n",
                                     unless_stopped=True)
            await asyncio.sleep(LEASE_S * 2)
            events = [event async for event in _stored_stream(store, "resp_m", -1)]
            return [json.loads(event.split("data: ", 1)[1]) for event in events[1:]]
        finally:
            await store.aclose()
            await admin.execute_command("ACL", "DELUSER", "no-mget")
            await admin.aclose()

    [ending] = asyncio.run(scenario())
    assert ending["type"] == "error" and ending["sequence_number"] == 1
    assert "NOPERM" in ending["message"] or "permission" in ending["message"], ending


def test_a_stream_that_ended_is_read_whole_after_its_lease_lapsed(redis_url: str) -> None:
    async def scenario() -> tuple[list[str], str]:
        store = RedisResponseStore.from_url(redis_url, lease_s=LEASE_S)
        try:
            await _stored(store, "resp_m")
            await store.append_event("resp_m", 0, "zero", unless_stopped=True)
            completed = StoredResponse({"id": "resp_m", "status": "completed", "output": []}, [])
            await store.put(completed, unless_stopped=True)
            await store.end_events("resp_m", 1, unless_stopped=True)
            await asyncio.sleep(LEASE_S * 2)
            return ([event async for event in store.events_after("resp_m", -1)],
                    (await store.get("resp_m")).response["status"])
        finally:
            await store.aclose()

    assert asyncio.run(scenario()) == (["zero"], "completed")


def test_a_generation_keeps_its_lease_as_long_as_it_runs_and_stops_once_it_lapses(
        redis_url: str) -> None:
    """Renewed at every look for a stop, the lease outlives it; taken away (as a long loss of
    Redis would), the generation stops and records nothing: the store has given it up."""
    async def scenario() -> tuple[CountingWork, list[str], CountingWork]:
        from redis.asyncio import Redis

        store = RedisResponseStore.from_url(redis_url, lease_s=LEASE_S)
        redis = Redis.from_url(redis_url)
        background = BackgroundResponses(store, stop_poll_s=POLL_S)
        try:
            await _stored(store, "resp_k")
            long_lived = CountingWork(steps=int(LEASE_S * 4 / (POLL_S / 4)))
            background.start("resp_k", long_lived.generate(), long_lived.stopped)
            statuses: list[str] = []
            while background.num_running:
                statuses.append((await store.get("resp_k")).response["status"])
                await asyncio.sleep(LEASE_S / 3)
            await _stored(store, "resp_n")
            lost = CountingWork()
            background.start("resp_n", lost.generate(), lost.stopped)
            await _until(lambda: lost.made > 2)
            await redis.delete(RedisResponseStore.LEASE_KEY_PREFIX + "resp_n")
            await _until(lambda: background.num_running == 0)
            return long_lived, statuses, lost
        finally:
            await redis.aclose()
            await store.aclose()

    long_lived, statuses, lost = asyncio.run(scenario())
    assert long_lived.ends == [] and not long_lived.was_cancelled
    assert len(statuses) >= 4 and set(statuses) == {"queued"}
    assert lost.was_cancelled and lost.ends == [] and lost.made < 1000


def test_a_generator_s_write_outlasts_a_redis_blip_and_lands_once(redis_url: str) -> None:
    """Redis paused for 3 s: a client's write fails at the 2 s socket timeout, the generator's
    is tried again and lands, its event once though its first try landed too, unanswered."""
    async def scenario() -> tuple[bool, float, list[str], bool]:
        from redis.asyncio import Redis

        store = RedisResponseStore.from_url(redis_url)
        redis = Redis.from_url(redis_url)
        try:
            await _stored(store, "resp_b")
            await redis.execute_command("CLIENT", "PAUSE", 3000, "ALL")
            started = asyncio.get_running_loop().time()
            added = await store.append_event("resp_b", 0, "zero", unless_stopped=True)
            took_s = asyncio.get_running_loop().time() - started
            await store.end_events("resp_b", 1)
            events = [event async for event in store.events_after("resp_b", -1)]
            await redis.execute_command("CLIENT", "PAUSE", 2500, "ALL")
            try:
                await store.put(StoredResponse({"id": "resp_c", "status": "completed", "output": []}, []))
                client_write_failed = False
            except ServiceUnavailableError:
                client_write_failed = True
            return added, took_s, events, client_write_failed
        finally:
            await redis.aclose()
            await store.aclose()

    added, took_s, events, client_write_failed = asyncio.run(scenario())
    assert added and 2.0 < took_s < RedisResponseStore.RETRY_S
    assert events == ["zero"] and client_write_failed


def test_a_stream_s_reader_outlasts_a_redis_blip_and_ends_with_an_error_past_its_retries(
        redis_url: str) -> None:
    """Paused 3 s: the reader waits it out and reads on; with retries shorter than the pause,
    its stream ends with an `error` event instead of a cut connection."""
    async def scenario(retry_s: float) -> list[str]:
        from redis.asyncio import Redis

        store = RedisResponseStore.from_url(redis_url)
        store.RETRY_S = retry_s
        redis = Redis.from_url(redis_url)
        response_id = f"resp_r{int(retry_s)}"
        try:
            await _stored(store, response_id)
            await store.append_event(response_id, 0, "zero\n\n", unless_stopped=True)
            reading = asyncio.ensure_future(_collected(_stored_stream(store, response_id, -1)))
            await asyncio.sleep(POLL_S)
            await redis.execute_command("CLIENT", "PAUSE", 3000, "ALL")
            await asyncio.sleep(3.5)
            await store.append_event(response_id, 1, "one\n\n", unless_stopped=True)
            await store.end_events(response_id, 2, unless_stopped=True)
            return await asyncio.wait_for(reading, 5)
        finally:
            await redis.aclose()
            await store.aclose()

    assert asyncio.run(scenario(RedisResponseStore.RETRY_S)) == ["zero\n\n", "one\n\n"]
    zero, error = asyncio.run(scenario(0.5))
    assert zero == "zero\n\n" and error.startswith("event: error\n")
    assert json.loads(error.split("data: ", 1)[1])["sequence_number"] == 1


async def _collected(events: Any) -> list[str]:
    return [event async for event in events]
