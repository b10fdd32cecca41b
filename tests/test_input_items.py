"""The input items of a stored response, a page at a time: `items_page` alone, then
GET /v1/responses/{id}/input_items on the shared mesh with the official openai client."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from services.gateway.errors import InvalidRequestError
from services.gateway.input_items import items_page
from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
ITEMS = [{"id": f"msg_{index}", "type": "message", "role": "user", "content": f"turn {index}"}
         for index in range(5)]


def _ids(page: dict[str, Any]) -> list[str]:
    return [item["id"] for item in page["data"]]


@pytest.mark.parametrize(("order", "after", "before", "limit", "ids", "has_more"), [
    ("desc", None, None, 20, ["msg_4", "msg_3", "msg_2", "msg_1", "msg_0"], False),
    ("asc", None, None, 2, ["msg_0", "msg_1"], True),
    ("asc", "msg_1", None, 2, ["msg_2", "msg_3"], True),
    ("asc", "msg_2", None, 5, ["msg_3", "msg_4"], False),
    ("desc", "msg_3", None, 2, ["msg_2", "msg_1"], True),
    ("asc", None, "msg_3", 2, ["msg_1", "msg_2"], True),  # the page just before the cursor
    ("asc", "msg_0", "msg_3", 20, ["msg_1", "msg_2"], False),
])
def test_a_page_of_items_follows_its_order_and_cursors(order: Any, after: str | None, before: str | None,
                                                       limit: int, ids: list[str], has_more: bool) -> None:
    page = items_page(ITEMS, order=order, limit=limit, after=after, before=before)
    assert (_ids(page), page["has_more"]) == (ids, has_more)
    assert (page["object"], page["first_id"], page["last_id"]) == ("list", ids[0], ids[-1])


def test_a_string_content_is_listed_as_one_text_part_and_an_unknown_cursor_is_refused() -> None:
    items = [ITEMS[0], {"id": "msg_a", "type": "message", "role": "assistant", "content": "Hello"}]
    listed = items_page(items, order="asc", limit=20)["data"]
    assert [item["content"] for item in listed] == [[{"type": "input_text", "text": "turn 0"}],
                                                   [{"type": "output_text", "text": "Hello"}]]
    with pytest.raises(InvalidRequestError) as refused:
        items_page(ITEMS, order="asc", limit=20, after="msg_9")
    assert refused.value.param == "after"


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def test_a_response_lists_the_items_of_its_conversation_newest_first(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=4,
                                    input=[{"role": "user", "content": "Hi"},
                                           {"id": "msg_mine", "role": "user", "content": "Hello?"}])
    second = client.responses.create(model=MODEL, input="And again.", max_output_tokens=4,
                                     previous_response_id=first.id)
    listed = client.responses.input_items.list(second.id)
    items = [item.model_dump(exclude_none=True) for item in listed.data]
    # Newest first: the new input, the first response's output, then its input (instructions are
    # not an item); ids made where the client gave none, kept where it gave one.
    assert [(item["type"], item.get("role")) for item in items] == [
        ("message", "user"), *[(item.type, getattr(item, "role", None)) for item in reversed(first.output)],
        ("message", "user"), ("message", "user")]
    assert items[0]["content"] == [{"type": "input_text", "text": "And again."}]
    assert items[-2]["id"] == "msg_mine" and items[-1]["id"].startswith("msg_")
    assert [item["id"] for item in items[1:1 + len(first.output)]] == [
        item.id for item in reversed(first.output)]
    page = client.responses.input_items.list(second.id, order="asc", limit=1, after=items[-1]["id"])
    assert [item.id for item in page.data] == ["msg_mine"] and page.has_more


@pytest.mark.parametrize(("query", "param"), [({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                                               ({"order": "sideways"}, "order"), ({"after": "x"}, "after")])
def test_a_bad_listing_query_names_its_parameter(client: openai.OpenAI, query: dict[str, Any],
                                                 param: str) -> None:
    made = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_items.list(made.id, **query)
    assert refused.value.body["param"] == param


def test_a_response_not_stored_has_no_items_to_list(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
