"""`top_p: 0`, which OpenAI's API takes and vLLM's range leaves out, on every generating
endpoint of the shared mesh."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import RunningMesh
from tests.test_bad_input_sweep import GENERATING, post, with_fields


@pytest.mark.parametrize("path", sorted(GENERATING))
@pytest.mark.parametrize("top_p", [0, 1e-50])
def test_a_top_p_of_zero_samples_the_likeliest_token_as_openai_s_does(
        mesh: RunningMesh, path: str, top_p: float) -> None:
    """Was a 400 saying "greater than or equal to 1.401298464324817e-45": OpenAI's API takes 0
    (vLLM's range leaves it out). Hot sampling held to the likeliest token answers as greedy."""
    def answer(**fields: Any) -> str:
        reply = post(mesh, path, with_fields(path, max_tokens=8, max_output_tokens=8, **fields))
        assert reply.status_code == 200, reply.text
        body = reply.json()
        if path == "/v1/responses":
            assert body["top_p"] == fields.get("top_p", 1.0)
            return body["output"][0]["content"][0]["text"]
        choice = body["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    greedy = answer(temperature=0)
    assert [answer(temperature=1.5, top_p=top_p, seed=seed) for seed in (1, 2, 3)] == [greedy] * 3
