"""Stored responses (Responses API): `store`, `previous_response_id`, GET and DELETE
/v1/responses/{id}. The stores alone (in this process, and in a real redis-server), then through
the shared mesh with the official openai client."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx
import openai
import pytest

from services.gateway.errors import InvalidRequestError, ServiceUnavailableError
from services.gateway.response_store import (InMemoryResponseStore, PreviousResponseNotFoundError,
                                             RedisResponseStore, StoredResponse, conversation_before)
from services.gateway.responses_request import ResponsesRequest
from tests.conftest import (RunningMesh, background_response_polled_to_its_end, engines_idle_within,
                            free_port)

MODEL = "SmolLM2-135M-Instruct-bf16"


def _record(response_id: str, said: str, answered: str) -> StoredResponse:
    output = [{"type": "message", "id": f"msg_{response_id}", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": answered, "annotations": []}]}]
    return StoredResponse({"id": response_id, "object": "response", "output": output},
                          [{"type": "message", "role": "user", "content": said}])


class FakeClock:
    """Stands in for the monotonic clock, so a test can pass the TTL without waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_in_process_store_keeps_a_response_its_ttl_and_the_newest_past_its_bound() -> None:
    clock = FakeClock()
    store = InMemoryResponseStore(ttl_s=60, max_responses=2, clock=clock)

    async def scenario() -> list[Any]:
        await store.put(_record("resp_a", "hi", "hello"))
        seen: list[Any] = [(await store.get("resp_a")).response["id"]]
        clock.now = 61
        seen.append(await store.get("resp_a"))  # past its TTL
        for name in ("resp_b", "resp_c", "resp_d"):
            await store.put(_record(name, "hi", "hello"))
        seen.append([await store.get(name) is not None for name in ("resp_b", "resp_c", "resp_d")])
        seen.append((await store.delete("resp_c"), await store.delete("resp_c")))
        return seen

    assert asyncio.run(scenario()) == ["resp_a", None, [False, True, True], (True, False)]


def test_the_in_process_store_holds_at_most_its_characters_of_json() -> None:
    """Logprobs make a response large: a count alone would let the store grow without bound."""
    one = len(_record("resp_0", "hi", "x" * 1000).encode())
    store = InMemoryResponseStore(max_chars=3 * one)

    async def held() -> list[bool]:
        for index in range(5):
            await store.put(_record(f"resp_{index}", "hi", "x" * 1000))
        return [await store.get(f"resp_{index}") is not None for index in range(5)]

    assert asyncio.run(held()) == [False, False, True, True, True]


def test_a_conversation_reads_its_input_then_the_output_and_names_a_response_not_stored() -> None:
    store = InMemoryResponseStore()

    async def scenario() -> tuple[list[dict[str, Any]], str]:
        await store.put(_record("resp_1", "one", "first"))
        items = await conversation_before(store, "resp_1")
        with pytest.raises(PreviousResponseNotFoundError) as caught:
            await conversation_before(store, "resp_2")
        return items, caught.value.message

    items, refusal = asyncio.run(scenario())
    assert [item["role"] for item in items] == ["user", "assistant"]
    assert "response 'resp_2' is not stored here" in refusal


def test_a_response_past_its_ttl_is_gone_for_delete_too() -> None:
    clock = FakeClock()
    store = InMemoryResponseStore(ttl_s=60, clock=clock)

    async def deleted() -> bool:
        await store.put(_record("resp_old", "hi", "hello"))
        clock.now = 61
        return await store.delete("resp_old")

    assert asyncio.run(deleted()) is False


def test_a_call_output_may_answer_a_call_of_the_stored_conversation() -> None:
    history = [{"type": "message", "role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather",
                "arguments": '{"city": "Paris"}', "status": "completed"}]
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    body = ResponsesRequest.model_validate({"model": MODEL, "previous_response_id": "resp_1",
                                            "input": [answer]})
    messages = body.after(history).chat_messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == "call_1"
    stray = ResponsesRequest.model_validate({"model": MODEL, "previous_response_id": "resp_1",
                                             "input": [answer | {"call_id": "call_2"}]})
    with pytest.raises(InvalidRequestError) as caught:
        stray.after(history)
    assert caught.value.param == "input" and "'call_2'" in caught.value.message
    # A call a parser left without a name is output no request could send: a 400, not a 500.
    nameless = [history[0], history[1] | {"name": ""}]
    with pytest.raises(InvalidRequestError) as caught:
        body.after(nameless)
    assert caught.value.param == "previous_response_id"


def test_the_redis_store_shares_responses_for_their_ttl(redis_url: str) -> None:
    async def scenario() -> tuple[Any, ...]:
        from redis.asyncio import Redis

        writer = RedisResponseStore.from_url(redis_url, ttl_s=600)
        reader = RedisResponseStore.from_url(redis_url, ttl_s=600)
        raw = Redis.from_url(redis_url)
        try:
            await writer.put(_record("resp_r", "hi", "hello"))
            read = await reader.get("resp_r")
            ttl_s = await raw.ttl("backport:response:resp_r")
            await raw.set("backport:response:resp_junk", "not json")
            junk = await reader.get("resp_junk")
            deleted = (await reader.delete("resp_r"), await writer.get("resp_r"))
            return read, ttl_s, junk, deleted
        finally:
            await raw.aclose()
            await writer.aclose()
            await reader.aclose()

    read, ttl_s, junk, deleted = asyncio.run(scenario())
    assert read == _record("resp_r", "hi", "hello")
    assert 590 < ttl_s <= 600
    assert junk is None
    assert deleted == (True, None)


def test_a_redis_store_that_cannot_be_reached_is_unavailable() -> None:
    async def scenario() -> None:
        store = RedisResponseStore.from_url(f"redis://127.0.0.1:{free_port()}/0")
        try:
            await store.get("resp_x")
        finally:
            await store.aclose()

    with pytest.raises(ServiceUnavailableError, match="the response store"):
        asyncio.run(scenario())


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def test_a_response_is_stored_and_retrieved_as_it_was_sent(client: openai.OpenAI) -> None:
    made = client.responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=8,
                                   metadata={"k": "v"})
    assert made.store is True and made.previous_response_id is None
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    *_, last = client.responses.create(model=MODEL, input="Say hello.", temperature=0,
                                       max_output_tokens=8, stream=True)
    assert last.type == "response.incomplete"
    assert client.responses.retrieve(last.response.id).model_dump() == last.response.model_dump()


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    """The continuation's prompt is the conversation sent whole: the same tokens, the same answer."""
    first_turn = "My name is Ada and I live in Paris."
    first = client.responses.create(model=MODEL, input=first_turn, temperature=0, max_output_tokens=12,
                                    instructions="Answer briefly.")
    second_turn = "What is my name?"
    continued = client.responses.create(model=MODEL, previous_response_id=first.id, input=second_turn,
                                        temperature=0, max_output_tokens=12)
    whole = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=12, store=False,
        input=[{"role": "user", "content": first_turn}, *[item.model_dump() for item in first.output],
               {"role": "user", "content": second_turn}])
    assert continued.previous_response_id == first.id
    # Instructions are not carried over (OpenAI's rule), so `whole` sends none either.
    assert continued.usage.input_tokens == whole.usage.input_tokens
    assert continued.output_text == whole.output_text
    third = client.responses.create(model=MODEL, previous_response_id=continued.id,
                                    input="And where do I live?", temperature=0, max_output_tokens=4)
    assert third.usage.input_tokens > continued.usage.input_tokens + continued.usage.output_tokens


def test_a_call_output_answers_a_call_of_the_stored_response(client: openai.OpenAI) -> None:
    """An agent's loop: the model calls a tool, the next request sends only the tool's output."""
    weather = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
               "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                              "properties": {"city": {"type": "string", "maxLength": 24}}}}
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                     tools=[weather], tool_choice="required", temperature=0,
                                     max_output_tokens=40)
    (call,) = [item for item in called.output if item.type == "function_call"]
    answered = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[weather], temperature=0,
        max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert answered.status == "incomplete" and answered.output_text
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=MODEL, previous_response_id=called.id, max_output_tokens=4,
            input=[{"type": "function_call_output", "call_id": "call_other", "output": "x"}])
    assert caught.value.body["param"] == "input"
    # The call sent back with its output, as a client without previous_response_id would: an
    # item the conversation has, which OpenAI's API refuses ("Duplicate item found").
    with pytest.raises(openai.BadRequestError) as repeated:
        client.responses.create(
            model=MODEL, previous_response_id=called.id, max_output_tokens=4,
            input=[call.model_dump(), {"type": "function_call_output", "call_id": call.call_id,
                                       "output": "Sunny, 24 C"}])
    assert repeated.value.body["param"] == "input"
    assert repeated.value.body["message"].startswith(f"input[0].id: the conversation already "
                                                     f"has an item with id {call.id!r}")


def test_a_response_is_continued_while_it_is_kept_whatever_became_of_those_it_continued(
        client: openai.OpenAI, mesh: RunningMesh) -> None:
    """Each response keeps its whole conversation: one continued while the response that began
    the conversation has expired (here, been deleted) still has it."""
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0,
                                    max_output_tokens=4)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, temperature=0,
                                     input="I live in Paris.", max_output_tokens=4)
    assert httpx.delete(f"{mesh.base_url}/responses/{first.id}", timeout=30).status_code == 200
    third = client.responses.create(model=MODEL, previous_response_id=second.id, temperature=0,
                                    input="Where do I live?", max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_a_response_not_stored_cannot_be_retrieved_or_continued(client: openai.OpenAI) -> None:
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(unstored.id)
    assert caught.value.body["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                previous_response_id=unstored.id)
    assert refused.value.body["param"] == "previous_response_id"
    assert refused.value.body["code"] == "previous_response_not_found"


def test_a_deleted_response_is_gone(client: openai.OpenAI, mesh: RunningMesh) -> None:
    made = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    deleted = httpx.delete(f"{mesh.base_url}/responses/{made.id}", timeout=30)
    assert deleted.json() == {"id": made.id, "object": "response", "deleted": True}
    assert httpx.delete(f"{mesh.base_url}/responses/{made.id}", timeout=30).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


# Background responses (`background: true`): answered `queued`, generated after, polled by GET.
# Far more than the wait below lets the engine make: a generation not stopped outlasts it.
LONG_TOKENS = 2000


def _long_background_response_running(client: openai.OpenAI) -> Any:
    """A background response the engine runs (its engine call starts after the answer)."""
    queued = client.responses.create(model=MODEL, input="Tell a long story.", background=True,
                                     max_output_tokens=LONG_TOKENS, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 60
    while client.responses.retrieve(queued.id).status == "queued":
        assert time.monotonic() < deadline, "the engine never ran the background response"
        time.sleep(0.1)
    return queued


def test_a_background_response_is_answered_queued_and_polled_to_what_it_would_have_been(
        client: openai.OpenAI) -> None:
    asked = {"model": MODEL, "input": "Name three colours.", "temperature": 0, "max_output_tokens": 12}
    queued = client.responses.create(**asked, background=True)
    assert (queued.status, queued.background, queued.output, queued.usage) == ("queued", True, [], None)
    made = background_response_polled_to_its_end(client, queued.id)
    at_once = client.responses.create(**asked)
    assert made.status == at_once.status == "incomplete"
    assert made.output_text == at_once.output_text and made.output_text
    assert made.usage.model_dump() == at_once.usage.model_dump()
    assert (made.id, made.created_at, made.background) == (queued.id, queued.created_at, True)
    continued = client.responses.create(model=MODEL, input="And three more.", max_output_tokens=2,
                                        previous_response_id=made.id)
    assert continued.usage.input_tokens > made.usage.input_tokens + made.usage.output_tokens


def test_a_background_response_still_running_cannot_be_continued(client: openai.OpenAI) -> None:
    """Its output is not there yet: the new response would go on without it."""
    running = _long_background_response_running(client)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="And then?", max_output_tokens=2,
                                    previous_response_id=running.id)
        assert refused.value.body["param"] == "previous_response_id"
        assert "in_progress" in refused.value.body["message"]
    finally:
        client.responses.cancel(running.id)


def test_a_background_response_cancelled_stops_its_generation(client: openai.OpenAI,
                                                               mesh: RunningMesh) -> None:
    queued = _long_background_response_running(client)
    cancelled = client.responses.cancel(queued.id)
    assert (cancelled.id, cancelled.status) == (queued.id, "cancelled")
    assert engines_idle_within([mesh.engine_address], 10), "the engine still generates the cancelled response"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # again: the same answer


def test_a_background_response_deleted_is_stopped_and_not_stored_again(client: openai.OpenAI,
                                                                        mesh: RunningMesh) -> None:
    queued = _long_background_response_running(client)
    assert httpx.delete(f"{mesh.base_url}/responses/{queued.id}", timeout=30).status_code == 200
    assert engines_idle_within([mesh.engine_address], 10), "the engine still generates the deleted response"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)


def test_a_background_response_the_engine_refuses_is_polled_as_failed(client: openai.OpenAI) -> None:
    """The engine call starts after the answer: its refusal is the stored response's error."""
    queued = client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=4,
                                     extra_body={"structured_outputs": {"regex": "("}})
    failed = background_response_polled_to_its_end(client, queued.id)
    assert failed.status == "failed" and failed.output == []
    assert failed.error.code == "server_error" and "structured_outputs" in failed.error.message


def test_only_a_running_background_response_can_be_cancelled(client: openai.OpenAI) -> None:
    made = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(made.id)
    assert refused.value.body["param"] == "response_id" and "incomplete" in refused.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_a_background_stream_outlives_its_client_and_is_read_again_from_any_event(
        client: openai.OpenAI) -> None:
    asked = {"model": MODEL, "input": "Name three colours.", "temperature": 0, "max_output_tokens": 12}
    stream = client.responses.create(**asked, background=True, stream=True)
    first_three = [event for _, event in zip(range(3), stream, strict=False)]
    stream.close()  # the client goes; the response is still made
    response_id = first_three[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    events = [*first_three, *rest]
    assert (events[0].type, events[0].response.status) == ("response.created", "queued")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    assert [event.model_dump() for event in client.responses.retrieve(response_id, stream=True)] == [
        event.model_dump() for event in events]
    assert client.responses.retrieve(response_id).model_dump() == events[-1].response.model_dump()
    # Of two generations, the text deltas may carry their tokens in different numbers of events.
    def kinds(stream: Any) -> list[str]:
        return [kind for kind, _ in itertools.groupby(event.type for event in stream)]

    assert kinds(events[1:]) == kinds(client.responses.create(**asked, stream=True))[1:]
    assert events[-1].response.output_text == client.responses.create(**asked).output_text


def test_a_background_stream_cancelled_ends_as_an_aborted_stream_does(client: openai.OpenAI,
                                                                       mesh: RunningMesh) -> None:
    stream = client.responses.create(model=MODEL, input="Tell a long story.", background=True,
                                     stream=True, max_output_tokens=LONG_TOKENS,
                                     extra_body={"ignore_eos": True})
    events: list[Any] = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta" and events[-2].type != event.type:
            client.responses.cancel(events[0].response.id)  # at its first text
    assert (events[-1].type, events[-1].response.status) == ("response.incomplete", "cancelled")
    assert engines_idle_within([mesh.engine_address], 10)


def test_only_a_background_stream_is_streamed_again(client: openai.OpenAI) -> None:
    made = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, background=True)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.retrieve(made.id, stream=True)
    assert refused.value.body["param"] == "stream"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.retrieve(made.id, stream=True, starting_after=-1)
    assert refused.value.body["param"] == "starting_after"
