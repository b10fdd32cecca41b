"""CORS and request ids on a real gateway process (over the shared mesh's engine and tokenizer
service): a page of an allowed origin can read the headers the gateway answers with, a 401
included, and every answer carries an `X-Request-Id`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.cluster.processes import gateway_over
from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
API_KEY = "sk-cors-test"
ALLOWED_ORIGIN = "https://chat.example"


@pytest.fixture(scope="module")
def cors_gateway(mesh: RunningMesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gateway_over(mesh, tmp_path_factory.mktemp("cors-gateway"), "--allowed-origin", ALLOWED_ORIGIN,
                      "--api-key", API_KEY, "--expose-engine-header") as base_url:
        yield base_url


def exposed_headers(reply: httpx.Response) -> set[str]:
    """What a page's script may read of `reply` beyond the CORS-safelisted headers."""
    listed = reply.headers.get("access-control-expose-headers", "")
    return {name.strip().lower() for name in listed.split(",") if name.strip()}


def test_a_page_can_read_which_engine_served_it(cors_gateway: str) -> None:
    """`--expose-engine-header` is for clients to see the engine; a browser hides a header
    the answer does not expose."""
    reply = httpx.post(f"{cors_gateway}/completions", timeout=60,
                       headers={"Origin": ALLOWED_ORIGIN, "Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert reply.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert reply.headers["x-backport-engine"]
    assert "x-backport-engine" in exposed_headers(reply)


def test_a_401_carries_cors_headers_and_exposes_its_challenge(cors_gateway: str) -> None:
    """Refused before any route, the 401 must still pass through CORS, or the page sees a
    network error instead of the refusal."""
    reply = httpx.get(f"{cors_gateway}/models", headers={"Origin": ALLOWED_ORIGIN,
                                                         "Authorization": "Bearer sk-wrong"})
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "invalid_api_key"
    assert reply.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert reply.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert "www-authenticate" in exposed_headers(reply)



def test_every_answer_carries_a_request_id_the_sdk_reads(cors_gateway: str) -> None:
    """OpenAI's API names each answer by `x-request-id`, which the SDK gives as `request_id`:
    a new one each time, on answers, streams, refusals and a page's reads alike."""
    client = openai.OpenAI(base_url=cors_gateway, api_key=API_KEY, max_retries=0, timeout=60)
    asked = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    first = client.chat.completions.with_raw_response.create(**asked)
    second = client.chat.completions.with_raw_response.create(**asked)
    assert first.request_id and first.request_id.startswith("req_")
    assert second.request_id and second.request_id != first.request_id
    with client.chat.completions.with_streaming_response.create(**asked, stream=True) as streamed:
        assert streamed.request_id and streamed.request_id.startswith("req_")
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(**asked | {"model": "no-such-model"})
    assert unknown.value.request_id and unknown.value.request_id.startswith("req_")

    refused = httpx.get(f"{cors_gateway}/models", headers={"Origin": ALLOWED_ORIGIN})
    assert refused.status_code == 401 and refused.headers["x-request-id"].startswith("req_")
    assert "x-request-id" in exposed_headers(refused)


@pytest.mark.parametrize(("sent", "echoed"), [
    ("trace-7f3a/42", True),
    ("x" * 256, True),
    ("x" * 257, False),
    ("two words", False),
])
def test_a_client_s_own_request_id_comes_back_where_usable(cors_gateway: str, sent: str,
                                                           echoed: bool) -> None:
    """As vLLM's `--enable-request-id-headers`: the id a client sent names its answer; one too
    long for a log line, or not visible ASCII, is replaced."""
    reply = httpx.get(f"{cors_gateway}/models", headers={"Authorization": f"Bearer {API_KEY}",
                                                         "X-Request-Id": sent})
    assert reply.status_code == 200
    if echoed:
        assert reply.headers["x-request-id"] == sent
    else:
        assert reply.headers["x-request-id"].startswith("req_")
