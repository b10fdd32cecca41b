"""The order of a token's top alternatives, from candidates as vLLM's engine hands them over:
the token itself first, then its top-k by rank, the token among them once (a dict keeps the
first key's place and the later value)."""

from __future__ import annotations

from vllm.logprobs import Logprob

from services.engine.vllm_engine import _token_logprob


def candidates(token: tuple[int, float, int], top: list[tuple[int, float]]) -> dict[int, Logprob]:
    as_vllm_builds_them = [token, *((token_id, logprob, rank)
                                    for rank, (token_id, logprob) in enumerate(top, start=1))]
    return {token_id: Logprob(logprob=logprob, rank=rank)
            for token_id, logprob, rank in as_vllm_builds_them}


def test_of_equal_logprobs_the_token_itself_comes_first() -> None:
    """bf16 logits tie: greedy took token 7, top-k ranked 3 first. vLLM's server lists 7 first
    (seen on an AMD EPYC host, where the parity test with vLLM's server failed on it)."""
    tied = candidates((7, -0.7199, 1), [(3, -0.7199), (7, -0.7199)])
    assert [token_id for token_id, _, _ in _token_logprob(7, tied, 2).top] == [7, 3]


def test_a_sampled_token_outside_the_top_is_not_among_them() -> None:
    sampled = candidates((9, -3.0, 4), [(3, -0.5), (5, -1.0)])
    entry = _token_logprob(9, sampled, 2)
    assert [(token_id, rank) for token_id, _, rank in entry.top] == [(3, 1), (5, 2)]
    assert (entry.logprob, entry.rank) == (-3.0, 4)


def test_a_sampled_token_inside_the_top_keeps_its_place() -> None:
    sampled = candidates((5, -1.0, 2), [(3, -0.5), (5, -1.0), (8, -2.0)])
    assert [token_id for token_id, _, _ in _token_logprob(5, sampled, 3).top] == [3, 5, 8]
