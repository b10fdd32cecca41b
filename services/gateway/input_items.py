"""The input items of a stored response, a page at a time (GET /v1/responses/{id}/input_items).

They are the items the response was made from: its conversation before it, the input and output
of the responses it continued included, oldest first as stored. Listed as OpenAI lists them: a
message whose content is a string has it as one text part.
"""

from __future__ import annotations

from typing import Any, Literal

from services.gateway.errors import InvalidRequestError

Order = Literal["asc", "desc"]


def input_items_page(items: list[dict[str, Any]], *, order: Order, limit: int,
                     after: str | None = None, before: str | None = None) -> dict[str, Any]:
    """The list object of the `limit` items after `after` (or before `before`) in `order`."""
    ordered = [_listed(item) for item in (items if order == "asc" else reversed(items))]
    start, end = 0, len(ordered)
    if after is not None:
        start = _index_of(ordered, after, "after") + 1
    if before is not None:
        end = _index_of(ordered, before, "before")
    in_range = ordered[start:end]
    # `before` alone pages backwards: the items just before the cursor.
    page = in_range[-limit:] if before is not None and after is None else in_range[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
            "has_more": len(page) < len(in_range)}


def _index_of(items: list[dict[str, Any]], item_id: str, param: str) -> int:
    for index, item in enumerate(items):
        if item.get("id") == item_id:
            return index
    raise InvalidRequestError(f"{param}: no input item of this response has id {item_id!r}",
                              param=param)


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type", "message") != "message" or not isinstance(item.get("content"), str):
        return item
    part_type = "output_text" if item.get("role") == "assistant" else "input_text"
    return {**item, "type": "message", "content": [{"type": part_type, "text": item["content"]}]}
