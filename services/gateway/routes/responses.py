"""/v1/responses: OpenAI's Responses API, served on the chat path.

The conversation is rendered as chat messages, generated and parsed exactly as a chat
completion is (`prepare_chat_generation`); the parsed message is then shaped as output items: a
`reasoning` item when the model reasoned, a `message` item when it wrote content, one
`function_call` item per tool call. Streaming sends OpenAI's typed events, each with a
`sequence_number` from 0, built by the same code that builds the non-streamed output, so a
client that accumulates them gets the same items; `response.completed` (or `response.incomplete`
when `max_output_tokens` cut the output) carries the whole response last. A request the engine
aborted (its `Abort` call) ends with status `cancelled`, as in vLLM; streamed, its last event is
`response.incomplete`, since OpenAI's stream has no cancelled event. A stream that fails once
begun closes the item it was writing, then sends an `error` event and `response.failed` with the
output so far. An item a response ended before it was finished has status `incomplete`.

Logprobs (`include: ["message.output_text.logprobs"]`, `top_logprobs` alternatives) follow vLLM:
each generation delta's tokens go with the message text it adds, on its `output_text.delta` and
in the `output_text` part. A whole response is one delta, so its message lists every token of the
output, reasoning and call markup included; a stream's reasoning and calls show none. Tokens
that write nothing yet go with the next text, and those left when the message ends (the EOS)
close it on an empty delta. A call alone, or `include_reasoning: false` with a parser, shows none.

Unless `store` is false, a response is stored as it was last sent
(`services.gateway.response_store`), for GET and DELETE /v1/responses/{id} and for a later
request's `previous_response_id`, which puts the stored conversation's items before that
request's input. A `background` response is answered `queued` before its engine call starts and
generated after (`services.gateway.background_responses`), stored `in_progress` once the engine
runs it, then as it ended; POST /v1/responses/{id}/cancel stops it, `cancelled`. Streamed, its
events go to the store as they are made, and the client reads them from there: GET
/v1/responses/{id}?stream=true (`starting_after`) reads them again, on any replica.

GET /v1/responses/{id}/input_items lists the items a stored response was made from. POST
/v1/responses/input_tokens counts the prompt tokens a request would be given, without generating.

A response made in a `conversation` (`services.gateway.routes.conversations`) has that
conversation's items before its input, and adds its input and output there once it ends
`completed` or `incomplete`, whether or not it is stored.

`truncation: "auto"` drops the fewest items from the start of an input (its stored history
included) that leave room in the context for `max_output_tokens`, as OpenAI's does; without it
an input beyond the context is a 400.

Not supported: stored `prompt`s (a 400), built-in and custom tools (web search, file
search, code interpreter, computer use, MCP, custom; only function tools), input parts other
than text (images, files, audio), encrypted reasoning, reasoning summaries (the reasoning comes
as `reasoning_text` content, `summary` stays empty), and more than one output choice (`include`
values naming output never made here are accepted).
"""

from __future__ import annotations

import copy
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from services.gateway.background_responses import BackgroundResponses, EarlyEnd
from services.gateway.backend import GatewayBackend, ServedModel
from services.gateway.conversation_store import ConversationStore, ItemIdTaken
from services.gateway.errors import ContextLengthError, GatewayError, InvalidRequestError
from services.gateway.generation import ChoiceDelta, TokenLogprob, UsageCounts
from services.gateway.input_items import Order, items_page
from services.gateway.parsing import MessageDelta, ToolCallDelta
from services.gateway.requests import backend_of, check_model
from services.gateway.response_store import (LAPSED_MESSAGE, BackgroundResponseLostError,
                                             ResponseStore, StoredResponse, conversation_before)
from services.gateway.responses_request import (InputTokensRequest, ResponsesRequest,
                                                responses_message, responses_param)
from services.gateway.routes.chat import (ChatGeneration, chat_logprobs, parse_choice_delta,
                                          prepare_chat_generation, render_chat_prompt)
from services.gateway.routes.conversations import conversation_items, with_new_ids
from services.gateway.schemas import ChatCompletionRequest, now
from services.gateway.sse import EventStreamResponse, sse_event

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["responses"])

ItemStatus = Literal["completed", "incomplete"]
# The statuses of a response whose input and output go to its conversation: those with output.
_TURN_STATUSES = frozenset({"completed", "incomplete"})
ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]


@router.post("/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> JSONResponse | EventStreamResponse:
    backend = backend_of(request)
    history = await _history(body, backend)
    whole_input = body.after(history) if body.history_source is not None else body
    # As OpenAI's: an item id once in a conversation, whether kept as one or as a chain of
    # responses (an output item sent back with `previous_response_id` is a 400).
    own_items = with_new_ids(body.input_items(), history, field="input")
    with _named_as_responses_fields():
        chat, started = await _prepared(whole_input, request)
        # A background response's engine call starts after its answer; a refusal then fails it.
        if not body.background:
            await started.generation.start()
    record = _Record(backend.response_store, [*history, *own_items]) if body.stores else None
    turn = (_ConversationTurn(backend.conversation_store, body.conversation_id, own_items)
            if body.conversation_id is not None else None)
    response = _Response(body, started, backend.served_model(), record, turn,
                         includes_reasoning=chat.include_reasoning)
    if body.background:
        queued = await response.in_background(backend.background_responses)
        if body.stream:
            return EventStreamResponse(_stored_stream(backend.response_store, response.id, -1))
        return JSONResponse(queued)
    if body.stream:
        return EventStreamResponse(response.events())
    return JSONResponse(await response.whole())


@router.post("/responses/input_tokens")
async def count_input_tokens(body: InputTokensRequest, request: Request) -> dict[str, Any]:
    """The prompt tokens a response to this request would be given: its history, instructions,
    tools and input rendered as a response renders them (after `truncation: "auto"` drops what
    it would). Counted past the context too, where a response would be a 400."""
    backend = backend_of(request)
    model = backend.served_model()
    body = body.model_copy(update={"model": body.model or model.name})
    history = await _history(body, backend)
    whole_input = body.after(history) if body.history_source is not None else body
    with _named_as_responses_fields():
        if whole_input.truncation == "auto":
            _, prepared = await _prepared(whole_input, request)
            num_tokens = prepared.generation.usage.prompt_tokens
        else:
            chat = whole_input.chat_request()
            prompt_ids, _ = await render_chat_prompt(backend, check_model(backend, chat.model),
                                                     chat, request)
            num_tokens = len(prompt_ids)
    return {"object": "response.input_tokens", "input_tokens": num_tokens}


async def _history(body: ResponsesRequest, backend: GatewayBackend) -> list[dict[str, Any]]:
    """The stored items the request goes on from: a previous response's or a conversation's."""
    if body.previous_response_id is not None:
        return await conversation_before(backend.response_store, body.previous_response_id)
    if body.conversation_id is not None:
        return await conversation_items(backend.conversation_store, body.conversation_id,
                                        param="conversation")
    return []


@contextmanager
def _named_as_responses_fields() -> Iterator[None]:
    """The chat path's errors name its own fields; the client wrote the Responses ones."""
    try:
        yield
    except InvalidRequestError as error:
        param = responses_param(error.param)
        message = error.message.replace(error.param, param) if error.param and param else error.message
        raise type(error)(responses_message(message), param=param) from error


async def _prepared(whole_input: ResponsesRequest,
                    request: Request) -> tuple[ChatCompletionRequest, ChatGeneration]:
    """The chat request the input makes and its generation, not started. With `truncation:
    "auto"`, an input that leaves no room for `max_output_tokens` in the context (or too long
    for it) loses the fewest items from its start that leave it (OpenAI's rule): a binary search
    over whole items, each try a render. The fewest where dropping an item never lengthens the
    prompt; a template that adds its default system prompt when the first message is not a
    system one can, and then more may go."""
    request_id = _new_id("resp")

    async def tried(num_dropped: int) -> tuple[ChatCompletionRequest, ChatGeneration] | None:
        kept = whole_input.without_first_items(num_dropped)
        if kept.num_items == 0:
            return None
        chat = kept.chat_request()
        try:
            prepared = await prepare_chat_generation(chat, request, request_id=request_id)
        except ContextLengthError as error:
            if whole_input.truncation != "auto" or error.param != "messages":
                raise
            return None
        if whole_input.truncation == "auto" and not _leaves_room(whole_input, prepared, request):
            return None
        return chat, prepared

    whole = await tried(0)
    if whole is not None:
        return whole
    fewest, most = 1, whole_input.num_items - 1
    found = None
    while fewest <= most:
        middle = (fewest + most) // 2
        attempt = await tried(middle)
        if attempt is None:
            fewest = middle + 1
        else:
            found, most = attempt, middle - 1
    if found is None:
        wanted = whole_input.max_output_tokens
        raise ContextLengthError(
            f"This model's maximum context length is {_max_model_len(request)} tokens: with "
            "truncation auto, the instructions and the input's last item alone leave no room for "
            + (f"max_output_tokens={wanted}" if wanted else "output"), param="messages")
    return found


def _leaves_room(body: ResponsesRequest, prepared: ChatGeneration, request: Request) -> bool:
    # Without max_output_tokens, room for a token, as the chat path asks.
    wanted = body.max_output_tokens or 1
    return prepared.generation.usage.prompt_tokens + wanted <= _max_model_len(request)


def _max_model_len(request: Request) -> int:
    return backend_of(request).served_model().max_model_len


@router.get("/responses/{response_id}", response_model=None)
async def retrieve_response(response_id: str, request: Request, stream: bool = False,
                            starting_after: Annotated[int | None, Query(ge=0)] = None,
                            ) -> dict[str, Any] | EventStreamResponse:
    """The response as last stored; or, `stream`ed, a background stream's events again, those
    after event `starting_after` (all without it), then each as it is made."""
    store = backend_of(request).response_store
    record = await store.get(response_id)
    if record is None:
        raise ResponseNotFoundError(response_id)
    if not stream:
        return record.response
    if not await store.has_events(response_id):
        raise InvalidRequestError(f"response {response_id!r} was not streamed in the background; "
                                  "retrieve it without stream", param="stream")
    return EventStreamResponse(_stored_stream(
        store, response_id, starting_after if starting_after is not None else -1))


@router.get("/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Order = "desc",
                           after: str | None = None, before: str | None = None) -> dict[str, Any]:
    """The items the response was made from (`services.gateway.input_items`); `include` asks
    for nothing this server makes, and is not read."""
    record = await backend_of(request).response_store.get(response_id)
    if record is None:
        raise ResponseNotFoundError(response_id)
    return items_page(record.input_items, order=order, limit=limit, after=after, before=before)


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    backend = backend_of(request)
    record = await backend.response_store.get(response_id)
    if record is not None and record.is_running:
        # Else its generator would store it again as it goes on.
        await backend.background_responses.stop(response_id, "deleted")
    if not await backend.response_store.delete(response_id):
        raise ResponseNotFoundError(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Stops a background response, which keeps what it was when stopped, `cancelled` (as in
    vLLM: `queued` or `in_progress` ones have no output yet). Cancelling again answers the same."""
    backend = backend_of(request)
    record = await backend.response_store.get(response_id)
    if record is None:
        raise ResponseNotFoundError(response_id)
    status = record.response["status"]
    if status == "cancelled":
        return record.response
    if not record.is_running:
        raise InvalidRequestError(f"response {response_id!r} is {status}: only a background "
                                  "response still queued or in progress can be cancelled",
                                  param="response_id")
    # Stopped first: from then on the generator's own writes are refused.
    await backend.background_responses.stop(response_id, "cancelled")
    cancelled = {**record.response, "status": "cancelled"}
    await backend.response_store.put(StoredResponse(cancelled, record.input_items))
    return cancelled


async def _stored_stream(store: ResponseStore, response_id: str,
                         after: int) -> AsyncGenerator[str, None]:
    """A background response's events after event `after`, read from the store. Where the
    gateway making it was lost, the stream ends as the response now reads: failed, or as it was
    stopped meanwhile (a cancel); where the store stays out of reach past its retries, with an
    `error` event (the response may go on: its stream can be read again)."""
    number = after
    try:
        async for event in store.events_after(response_id, after):
            number += 1
            yield event
    except GatewayError as error:
        yield _sse(_error_event(error), number + 1)
    except BackgroundResponseLostError as lost:
        first_number = max(lost.num_events, number + 1)
        try:
            record = await store.get(response_id)
        except GatewayError as error:
            yield _sse(_error_event(error), first_number)
            return
        if record is None:
            return
        response = record.lapsed().response if record.is_running else record.response
        ending: list[dict[str, Any]] = [{"type": _last_event_type(response["status"]),
                                         "response": response}]
        if response["status"] == "failed":
            ending.insert(0, {"type": "error", "code": "server_error", "param": None,
                              "message": (response.get("error") or {}).get("message", LAPSED_MESSAGE)})
        for ending_number, event in enumerate(ending, start=first_number):
            yield _sse(event, ending_number)


class ResponseNotFoundError(GatewayError):
    status, type, code = 404, "invalid_request_error", "response_not_found"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"No response with id {response_id!r} is stored here (responses are kept "
                         "for the gateway's --response-ttl-s, and not at all with store: false).")


@dataclass(frozen=True, slots=True)
class _Record:
    """Where a response asked to be stored goes, with its conversation's input items."""

    store: ResponseStore
    input_items: list[dict[str, Any]]

    async def keep(self, response: dict[str, Any], *, unless_stopped: bool) -> None:
        """Stores the response; where `unless_stopped` (a background response's generator
        writing), not once it was stopped (cancelled, deleted, its lease lapsed)."""
        stored = StoredResponse(response, self.input_items)
        try:
            await self.store.put(stored, unless_stopped=unless_stopped)
        except GatewayError as error:
            # The answer is made; losing it for want of storage would cost the client more than
            # a later `previous_response_id` refused.
            logger.warning("response %s not stored: %s", stored.id, error.message)


@dataclass(frozen=True, slots=True)
class _ConversationTurn:
    """Where a response made in a conversation adds its input and output once it has ended."""

    store: ConversationStore
    conversation_id: str
    input_items: list[dict[str, Any]]

    async def add(self, response: dict[str, Any]) -> None:
        try:
            added = await self.store.add_items(self.conversation_id,
                                               [*self.input_items, *response["output"]],
                                               turn=response["id"])
        except GatewayError as error:
            # As for a response not stored: the answer is worth more than its turn kept.
            logger.warning("response %s not added to conversation %s: %s", response["id"],
                           self.conversation_id, error.message)
            return
        except ItemIdTaken as taken:
            # An input item's id, added by another request since this one checked its input.
            logger.warning("response %s not added to conversation %s: %s", response["id"],
                           self.conversation_id, taken)
            return
        if not added:
            logger.info("response %s not added to conversation %s: it was deleted",
                        response["id"], self.conversation_id)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items, built from its message deltas.

    `add` and `close` return the stream events announcing what they changed; a non-streamed
    response drops them, so both ways of answering build their items the same way.
    """

    def __init__(self, *, includes_reasoning: bool = True) -> None:
        # vLLM's `include_reasoning: false`: the reasoning is generated (and counted), not shown.
        self.includes_reasoning = includes_reasoning
        self.items: list[dict[str, Any]] = []
        self._open_index: int | None = None  # the item that text or arguments deltas extend
        self._output_index_by_call: dict[int, int] = {}
        # Logprobs of tokens that have written nothing yet: they go with the text that follows.
        self._pending_logprobs: list[dict[str, Any]] = []

    def add(self, delta: MessageDelta, logprobs: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """`logprobs` are the entries (the `output_text` part's shape) of the tokens that wrote
        `delta`: they go with the message text it adds; reasoning and calls show none."""
        events: list[dict[str, Any]] = []
        shown_reasoning = delta.reasoning_content if self.includes_reasoning else None
        text_logprobs: list[dict[str, Any]] = []
        if delta.content:
            text_logprobs, self._pending_logprobs = [*self._pending_logprobs, *logprobs], []
        elif shown_reasoning or delta.tool_calls:
            self._pending_logprobs = []
        else:
            self._pending_logprobs += logprobs
        if shown_reasoning:
            events += self._add_text("reasoning", shown_reasoning)
        if delta.content:
            events += self._add_text("message", delta.content, text_logprobs)
        for call in delta.tool_calls:
            events += self._add_call(call)
        return events

    def close(self, status: ItemStatus) -> list[dict[str, Any]]:
        """Ends the open item with `status`: the response's own, or `incomplete` where the
        response did not complete; a message takes the logprobs still held."""
        pending_logprobs, self._pending_logprobs = self._pending_logprobs, []
        if self._open_index is None:
            return []
        index, self._open_index = self._open_index, None
        item = self.items[index]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where,
                       "name": item["name"], "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events = [self._message_delta(index, "", pending_logprobs)] if pending_logprobs else []
                events.append({"type": "response.output_text.done", **where, "content_index": 0,
                               "text": part["text"], "logprobs": []})
            else:
                events = [{"type": "response.reasoning_text.done", **where, "content_index": 0,
                           "text": part["text"]}]
            events.append({"type": "response.content_part.done", **where, "content_index": 0,
                           "part": copy.deepcopy(part)})
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": copy.deepcopy(item)})
        return events

    def _add_text(self, kind: Literal["reasoning", "message"], text: str,
                  logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open_index is None or self.items[self._open_index]["type"] != kind:
            events += self.close("completed")
            events += self._open_text_item(kind)
        index = self._open_index
        assert index is not None
        if kind == "message":
            events.append(self._message_delta(index, text, logprobs or []))
            return events
        item = self.items[index]
        item["content"][0]["text"] += text
        events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "delta": text})
        return events

    def _message_delta(self, index: int, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        """Adds `text` and its tokens' `logprobs` to the message at `index`; the event saying so,
        its entries in the stream's shape, which has no `bytes` (OpenAI's, vLLM's)."""
        item = self.items[index]
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        return {"type": "response.output_text.delta", "item_id": item["id"], "output_index": index,
                "content_index": 0, "delta": text, "logprobs": [
                    {"token": entry["token"], "logprob": entry["logprob"],
                     "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]}
                                      for top in entry["top_logprobs"]]}
                    for entry in logprobs]}

    def _open_text_item(self, kind: Literal["reasoning", "message"]) -> list[dict[str, Any]]:
        if kind == "message":
            item: dict[str, Any] = {"type": "message", "id": _new_id("msg"), "role": "assistant",
                                    "status": "in_progress", "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        index = self._open(item)
        events = [{"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)},
                  {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                   "content_index": 0, "part": copy.deepcopy(part)}]
        item["content"].append(part)
        return events

    def _add_call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if call.id is not None:  # a call's first delta
            events += self.close("completed")
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": call.id,
                    "name": call.name or "", "arguments": "", "status": "in_progress"}
            self._output_index_by_call[call.index] = self._open(item)
            events.append({"type": "response.output_item.added",
                           "output_index": self._output_index_by_call[call.index],
                           "item": copy.deepcopy(item)})
        if call.arguments:
            index = self._output_index_by_call[call.index]
            item = self.items[index]
            item["arguments"] += call.arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": index, "delta": call.arguments})
        return events

    def _open(self, item: dict[str, Any]) -> int:
        self.items.append(item)
        self._open_index = len(self.items) - 1
        return self._open_index


class _StoredEvents:
    """A streamed background response's events, numbered as they go to the store."""

    def __init__(self, store: ResponseStore, response_id: str) -> None:
        self.store = store
        self.response_id = response_id
        self.next_number = 0

    async def append(self, event: dict[str, Any], *, even_if_stopped: bool = False) -> None:
        """Adds the event, unless the response was stopped and this is not how it ended."""
        if await self.store.append_event(self.response_id, self.next_number,
                                         _sse(event, self.next_number),
                                         unless_stopped=not even_if_stopped):
            self.next_number += 1

    async def end(self, *, even_if_stopped: bool = False) -> None:
        await self.store.end_events(self.response_id, self.next_number,
                                    unless_stopped=not even_if_stopped)


class _Response:
    """Shapes one started chat generation as a `response` object or its stream of events."""

    def __init__(self, body: ResponsesRequest, started: ChatGeneration, model: ServedModel,
                 record: _Record | None, turn: _ConversationTurn | None, *,
                 includes_reasoning: bool) -> None:
        self.id = started.request_id
        self.record = record
        self.turn = turn
        self.includes_reasoning = includes_reasoning
        self.created_at = now()
        self.body = body
        self.model_name = started.model_name
        # Echoed as sampled with, as vLLM and OpenAI echo them.
        self.temperature = body.temperature if body.temperature is not None else model.default_temperature
        self.top_p = body.top_p if body.top_p is not None else model.default_top_p
        self.generation = started.generation
        self.parser = started.parsers[0]
        # Not where they would spell out the reasoning `include_reasoning: false` leaves out
        # (vLLM drops them wherever a parser reads the output), as on chat.
        self.shows_logprobs = body.includes_logprobs and (includes_reasoning or self.parser is None)
        # Where a streamed background response's events go.
        self._log: _StoredEvents | None = None

    async def in_background(self, background: BackgroundResponses) -> dict[str, Any]:
        """Stores the response `queued` and answers with it; `background` generates it after,
        storing it as it goes (`in_progress` once the engine runs it) and as it ends. Streamed,
        its events go to the store, `response.created` first, for `events_after` to read."""
        assert self.record is not None  # a background response is stored: the request says so
        queued = self._shape("queued", [], None)
        # Unlike a finished answer's, these writes must not fail quietly: they are all there is.
        await self.record.store.put(StoredResponse(queued, self.record.input_items))
        if self.body.stream:
            self._log = _StoredEvents(self.record.store, self.id)
            await self._log.append({"type": "response.created", "response": queued})
        background.start(self.id, self._generate_in_background(), self._stopped_early)
        return queued

    async def _generate_in_background(self) -> None:
        log = self._log
        try:
            await self.generation.start()
            await self._kept(self._shape("in_progress", [], None))
            if log is None:
                await self.whole()
                return
        except GatewayError as error:
            await self._fail_in_background(_error_event(error))
            return
        except Exception:
            logger.exception("background response %s failed", self.id)
            await self._fail_in_background(_internal_error_event())
            return
        try:
            # The stream makes its own failure events, but for the store's.
            async with aclosing(self._stream(announces_creation=False)) as events:
                async for event in events:
                    await log.append(event)
            await log.end()
        except GatewayError as error:
            logger.warning("background response %s: stream not stored: %s", self.id, error.message)
            await self._fail_in_background(_error_event(error))

    async def _fail_in_background(self, failure: dict[str, Any]) -> None:
        events = await self._failure(OutputItems(), failure)
        if self._log is not None:
            for event in events:
                await self._log.append(event)
            await self._log.end()

    async def _stopped_early(self, end: EarlyEnd) -> None:
        assert self.record is not None
        if end == "deleted":
            # What it was storing as it was deleted goes too.
            await self.record.store.delete(self.id)
            return
        if end == "gateway_stopped":
            await self._fail_in_background({
                "type": "error", "code": "server_error", "param": None,
                "message": "the gateway stopped before the response was made"})
            return
        cancelled = await self._kept(self._shape("cancelled", [], None), even_if_stopped=True)
        if self._log is not None:
            # A cancelled stream ends as one the engine aborted does.
            await self._log.append({"type": _last_event_type("cancelled"), "response": cancelled},
                                   even_if_stopped=True)
            await self._log.end(even_if_stopped=True)

    async def whole(self) -> dict[str, Any]:
        choice = (await self.generation.collect())[0]
        output = OutputItems(includes_reasoning=self.includes_reasoning)
        output.add(parse_choice_delta(self.parser, ChoiceDelta(0, choice.text,
                                                                finish_reason=choice.finish_reason)),
                   self._logprobs(choice.logprobs))
        status = _status(choice.finish_reason)
        output.close(_item_status(status))
        return await self._kept(self._shape(status, output.items, self.generation.usage))

    async def events(self) -> AsyncGenerator[str, None]:
        """The stream; an error once it has begun is an `error` event, and the stream ends."""
        numbers = itertools.count()
        async with aclosing(self._stream()) as events:
            async for event in events:
                yield _sse(event, next(numbers))

    async def _stream(self, *,
                      announces_creation: bool = True) -> AsyncGenerator[dict[str, Any], None]:
        """The stream's events, not yet numbered."""
        opening = self._shape("in_progress", [], None)
        try:
            if announces_creation:
                yield {"type": "response.created", "response": opening}
            yield {"type": "response.in_progress", "response": opening}
        except GeneratorExit:
            # The client went before the deltas were read, which leaves the engine call started.
            self.generation.cancel()
            raise
        output = OutputItems(includes_reasoning=self.includes_reasoning)
        finish_reason: str | None = None
        failure: dict[str, Any] | None = None  # the `error` event, when the stream fails
        try:
            # Closed as soon as the stream ends or the client goes: that aborts the engine request.
            async with aclosing(self.generation.deltas()) as deltas:
                async for delta in deltas:
                    for event in output.add(parse_choice_delta(self.parser, delta),
                                            self._logprobs(delta.logprobs)):
                        yield event
                    finish_reason = delta.finish_reason or finish_reason
        except GatewayError as error:
            failure = _error_event(error)
        except Exception:
            logger.exception("response stream failed")
            failure = _internal_error_event()
        if failure is not None:
            for event in await self._failure(output, failure):
                yield event
            return
        status = _status(finish_reason)
        for event in output.close(_item_status(status)):
            yield event
        yield {"type": _last_event_type(status), "response": await self._kept(
            self._shape(status, output.items, self.generation.usage))}

    async def _failure(self, output: OutputItems, failure: dict[str, Any]) -> list[dict[str, Any]]:
        """The last events of a stream that failed. The item being written will never be
        finished: it ends `incomplete`, not left `in_progress`. The `error` event says what went
        wrong; `response.failed` ends the response's lifecycle, as a stream's last event must,
        with what was generated."""
        events = [*output.close("incomplete"), failure]
        failed = await self._kept(self._shape(
            "failed", output.items, self.generation.usage,
            error={"code": "server_error", "message": failure["message"]}))
        return [*events, {"type": "response.failed", "response": failed}]

    async def _kept(self, response: dict[str, Any], *,
                    even_if_stopped: bool = False) -> dict[str, Any]:
        """The response as it is now (sent, or polled in the background), stored first where it
        asked to be (`_Record.keep`); one made in a conversation adds its turn there once it
        has output to add."""
        if self.turn is not None and response["status"] in _TURN_STATUSES:
            # Before it is stored as ended: a client that polled it to its end and goes on in
            # the conversation finds its turn there. (A cancel that comes as it ends leaves it.)
            await self.turn.add(response)
        if self.record is not None:
            await self.record.keep(response, unless_stopped=self.body.background and not even_if_stopped)
        return response

    def _logprobs(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        """The entries of an `output_text` part (chat's, as vLLM's Responses server writes them
        too), where the request asked for them."""
        if not (self.shows_logprobs and entries):
            return []
        return chat_logprobs(entries, shows_token_ids=False)["content"]

    def _shape(self, status: ResponseStatus, output: list[dict[str, Any]], usage: UsageCounts | None,
               *, error: dict[str, str] | None = None) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": now() if status == "completed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model_name, "output": copy.deepcopy(output),
            "usage": _usage(usage) if usage is not None else None, "error": error,
            "instructions": body.instructions,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools],
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str)
                            else body.tool_choice.model_dump()),
            "temperature": self.temperature, "top_p": self.top_p,
            # vLLM's: the number of alternatives served, none where logprobs were not asked for.
            "top_logprobs": (body.top_logprobs or 0) if body.includes_logprobs else None,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": body.text.model_dump(by_alias=True, exclude_none=True),
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "truncation": body.truncation or "disabled",
            "metadata": body.metadata or {}, "user": body.user, "store": self.record is not None,
            "background": body.background, "previous_response_id": body.previous_response_id,
            "conversation": ({"id": body.conversation_id} if body.conversation_id is not None
                             else None),
        }


def _sse(event: dict[str, Any], number: int) -> str:
    event["sequence_number"] = number
    return f"event: {event['type']}\n{sse_event(event)}"


def _error_event(error: GatewayError) -> dict[str, Any]:
    return {"type": "error", "code": error.code or error.type, "message": error.message,
            "param": error.param}


def _internal_error_event() -> dict[str, Any]:
    return {"type": "error", "code": "internal_error", "message": "internal error while streaming",
            "param": None}


def _last_event_type(status: str) -> str:
    """The event that ends a stream with the response `status`: OpenAI's stream has no
    cancelled event, so a cancelled one ends as an incomplete one."""
    return "response.incomplete" if status == "cancelled" else f"response.{status}"


def _status(finish_reason: str | None) -> ResponseStatus:
    if finish_reason == "abort":
        return "cancelled"
    return "incomplete" if finish_reason == "length" else "completed"


def _item_status(status: ResponseStatus) -> ItemStatus:
    return "completed" if status == "completed" else "incomplete"


def _usage(usage: UsageCounts) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            # OpenAI counts writes to caches a request asks for; the prefix cache here is implicit.
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
