"""/v1/conversations: OpenAI's Conversations API.

A conversation holds items (`services.gateway.conversation_store`): those it was created with or
given (`POST .../items`, input items as a response's `input` takes them, at most 20 a request),
and the turns of the responses made in it (`conversation` on POST /v1/responses: its items go
before the input, and the response's input and output are added once it is `completed` or
`incomplete`). As in OpenAI's, an item's id is unique in its conversation (items are found and
deleted by id) and a `function_call_output` answers a call before it (`_new_items`). Items are
listed newest first by default, with `limit`, `order` and `after`; `include` asks for nothing
this server makes, and is not read. Metadata follows OpenAI's limits: at most 16 pairs, keys up
to 64 characters, values up to 512.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import Field, field_validator

from services.gateway.conversation_store import Conversation, ConversationStore, ItemIdTaken
from services.gateway.errors import GatewayError, InvalidRequestError, RequestFieldError
from services.gateway.input_items import Order, items_page, listed_item
from services.gateway.requests import backend_of
from services.gateway.responses_request import (InputItemModel, call_ids, check_call_outputs,
                                                parse_input_items, stored_items)
from services.gateway.schemas import Metadata, RequestBody, now

router = APIRouter(prefix="/v1", tags=["conversations"])

MAX_ITEMS_A_REQUEST = 20


class _Metadata(RequestBody):
    metadata: Metadata | None = None


def _items_field(value: Any, *, allows_none: bool) -> list[InputItemModel] | None:
    if value is None and allows_none:
        return None
    if not isinstance(value, list):
        raise RequestFieldError("items", "must be a list of input items")
    if not allows_none and not value:
        raise RequestFieldError("items", "must not be an empty list")
    if len(value) > MAX_ITEMS_A_REQUEST:
        raise RequestFieldError("items", f"at most {MAX_ITEMS_A_REQUEST} items a request, got {len(value)}")
    return parse_input_items(value, field="items")


class ConversationCreateRequest(_Metadata):
    items: list[InputItemModel] | None = None

    @field_validator("items", mode="before")
    @classmethod
    def _input_items(cls, value: Any) -> Any:
        return _items_field(value, allows_none=True)


class ConversationUpdateRequest(_Metadata):
    # Required, as OpenAI's; null clears it.
    metadata: Metadata | None = Field(...)


class ItemsCreateRequest(RequestBody):
    items: list[InputItemModel]

    @field_validator("items", mode="before")
    @classmethod
    def _input_items(cls, value: Any) -> Any:
        return _items_field(value, allows_none=False)


class ConversationNotFoundError(GatewayError):
    status, type, code = 404, "invalid_request_error", "conversation_not_found"

    def __init__(self, conversation_id: str, *, param: str | None = None) -> None:
        super().__init__(f"No conversation with id {conversation_id!r} is kept here (conversations "
                         "are kept for the gateway's --response-ttl-s from their last change).",
                         param=param)


class ItemNotFoundError(GatewayError):
    status, type, code = 404, "invalid_request_error", "item_not_found"

    def __init__(self, conversation_id: str, item_id: str) -> None:
        super().__init__(f"Conversation {conversation_id!r} has no item with id {item_id!r}.")


async def conversation_items(store: ConversationStore, conversation_id: str, *,
                             param: str | None = None) -> list[dict[str, Any]]:
    """The conversation's items, oldest first; a 404 (naming `param`) where it is not kept."""
    items = await store.items(conversation_id)
    if items is None:
        raise ConversationNotFoundError(conversation_id, param=param)
    return items


def _new_items(items: list[InputItemModel], earlier: list[dict[str, Any]], *,
              field: str) -> list[dict[str, Any]]:
    """`items` as the conversation will keep them, after its `earlier` ones: each call output
    answers a call before it, and no id is one the conversation has (OpenAI's rules; an item is
    found and deleted by its id)."""
    try:
        check_call_outputs(items, known_call_ids=call_ids(earlier), field=field)
    except RequestFieldError as error:
        raise InvalidRequestError(str(error), param=field) from None
    return with_new_ids(stored_items(items), earlier, field=field)


def with_new_ids(added: list[dict[str, Any]], earlier: list[dict[str, Any]], *,
                 field: str) -> list[dict[str, Any]]:
    """`added`, whose ids must be none of `earlier`'s nor repeat (a 400 naming `field`)."""
    held = {item.get("id") for item in earlier}
    given: dict[str, int] = {}
    for index, item in enumerate(added):
        if item["id"] in held:
            raise InvalidRequestError(f"{field}[{index}].id: the conversation already has an item "
                                      f"with id {item['id']!r}", param=field)
        if item["id"] in given:
            raise InvalidRequestError(f"{field}[{index}].id: {field}[{given[item['id']]}] has the "
                                      f"same id, {item['id']!r}", param=field)
        given[item["id"]] = index
    return added


@router.post("/conversations")
async def create_conversation(request: Request,
                              body: ConversationCreateRequest | None = None) -> dict[str, Any]:
    """Every field is optional, the body too."""
    body = body or ConversationCreateRequest()
    conversation = Conversation(f"conv_{uuid.uuid4().hex}", now(), body.metadata or {})
    await _store(request).create(conversation, _new_items(body.items or [], [], field="items"))
    return conversation.to_object()


@router.get("/conversations/{conversation_id}")
async def retrieve_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
    return (await _conversation(_store(request), conversation_id)).to_object()


@router.post("/conversations/{conversation_id}")
async def update_conversation(conversation_id: str, body: ConversationUpdateRequest,
                              request: Request) -> dict[str, Any]:
    store = _store(request)
    conversation = await _conversation(store, conversation_id)
    updated = Conversation(conversation.id, conversation.created_at, body.metadata or {})
    if not await store.update(updated):
        raise ConversationNotFoundError(conversation_id)  # deleted meanwhile
    return updated.to_object()


@router.delete("/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
    if not await _store(request).delete(conversation_id):
        raise ConversationNotFoundError(conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.post("/conversations/{conversation_id}/items")
async def create_items(conversation_id: str, body: ItemsCreateRequest, request: Request) -> dict[str, Any]:
    store = _store(request)
    added = _new_items(body.items, await conversation_items(store, conversation_id), field="items")
    try:
        if not await store.add_items(conversation_id, added):
            raise ConversationNotFoundError(conversation_id)  # deleted meanwhile
    except ItemIdTaken as taken:  # by an add that came between the check above and this one
        raise InvalidRequestError(f"items[{taken.index}].id: {taken}", param="items") from None
    return items_page(added, order="asc", limit=len(added))


@router.get("/conversations/{conversation_id}/items")
async def list_items(conversation_id: str, request: Request,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Order = "desc",
                     after: str | None = None) -> dict[str, Any]:
    items = await conversation_items(_store(request), conversation_id)
    return items_page(items, order=order, limit=limit, after=after, owner="this conversation")


@router.get("/conversations/{conversation_id}/items/{item_id}")
async def retrieve_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
    items = await conversation_items(_store(request), conversation_id)
    item = next((item for item in items if item.get("id") == item_id), None)
    if item is None:
        raise ItemNotFoundError(conversation_id, item_id)
    return listed_item(item)


@router.delete("/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
    """Answers with the conversation, as OpenAI does."""
    store = _store(request)
    conversation = await _conversation(store, conversation_id)
    if not await store.delete_item(conversation_id, item_id):
        raise ItemNotFoundError(conversation_id, item_id)
    return conversation.to_object()


def _store(request: Request) -> ConversationStore:
    return backend_of(request).conversation_store


async def _conversation(store: ConversationStore, conversation_id: str) -> Conversation:
    conversation = await store.get(conversation_id)
    if conversation is None:
        raise ConversationNotFoundError(conversation_id)
    return conversation
