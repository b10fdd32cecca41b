"""CORS on a real gateway process (over the shared mesh's engine and tokenizer service): a page
of an allowed origin can read the headers the gateway answers with, a 401 included."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
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

