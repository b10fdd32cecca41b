"""Chat logprobs as JSON: a logprob of -inf (a token the sampler's processing ruled out, in a
`processed_logprobs` engine) has no JSON spelling, so it is written as -9999.0, as vLLM does
and as completions and `prompt_logprobs` already were. No engine here produces one, so the
shaping is called directly."""

from __future__ import annotations

import json
import math

from services.gateway.generation import TokenLogprob, TopLogprob
from services.gateway.routes.chat import chat_logprobs


def test_an_infinite_logprob_is_written_as_vllm_writes_it() -> None:
    entries = [TokenLogprob(7042, "Paris", -0.25,
                            [TopLogprob(7042, "Paris", -0.25), TopLogprob(55, "Lyon", -math.inf)])]
    shaped = json.loads(json.dumps(chat_logprobs(entries, shows_token_ids=False), allow_nan=False))
    [entry] = shaped["content"]
    assert entry["logprob"] == -0.25
    assert [(top["token"], top["logprob"]) for top in entry["top_logprobs"]] == [
        ("Paris", -0.25), ("Lyon", -9999.0)]
