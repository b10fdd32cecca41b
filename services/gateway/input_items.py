"""Stored items a page at a time: a response's input items (GET /v1/responses/{id}/input_items)
and a conversation's items (GET /v1/conversations/{id}/items).

A response's are the items it was made from: its conversation before it, the input and output
of the responses it continued included, oldest first as stored. Listed as OpenAI lists them: a
message whose content is a string has it as one text part.
"""

from __future__ import annotations

from typing import Any, Literal

from services.gateway.errors import InvalidRequestError

Order = Literal["asc", "desc"]


def items_page(items: list[dict[str, Any]], *, order: Order, limit: int, after: str | None = None,
               before: str | None = None, owner: str = "this response") -> dict[str, Any]:
    """The list object of the `limit` items after `after` (or before `before`) in `order`; an
    unknown cursor is a 400 saying it is no item of `owner`."""
    ordered = [listed_item(item) for item in (items if order == "asc" else reversed(items))]
    start, end = 0, len(ordered)
    if after is not None:
        start = _index_of(ordered, after, "after", owner) + 1
    if before is not None:
        end = _index_of(ordered, before, "before", owner)
    in_range = ordered[start:end]
    # `before` alone pages backwards: the items just before the cursor.
    page = in_range[-limit:] if before is not None and after is None else in_range[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
            "has_more": len(page) < len(in_range)}


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """The item as a listing shows it."""
    if item.get("type", "message") != "message" or not isinstance(item.get("content"), str):
        return item
    part_type = "output_text" if item.get("role") == "assistant" else "input_text"
    return {**item, "type": "message", "content": [{"type": part_type, "text": item["content"]}]}


def _index_of(items: list[dict[str, Any]], item_id: str, param: str, owner: str) -> int:
    for index, item in enumerate(items):
        if item.get("id") == item_id:
            return index
    raise InvalidRequestError(f"{param}: no item of {owner} has id {item_id!r}", param=param)
