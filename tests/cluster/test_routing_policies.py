"""The router's choices, on the real `Router` (no processes needed)."""

from __future__ import annotations

import collections
import random

from services.gateway.circuit_breaker import CircuitBreaker
from services.gateway.routing import Candidate, Router, RoutingPolicy, prefix_key, rendezvous_order

ENGINES = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]


def router(policy: RoutingPolicy, load_bound: float = 1.25, load_slack: int = 0) -> Router:
    return Router(policy, block_tokens=16, affinity_max_tokens=256, load_bound=load_bound,
                  load_slack=load_slack)


def idle(addresses: list[str] = ENGINES) -> list[Candidate]:
    return [Candidate(a, 0) for a in addresses]


def test_prefix_key_ignores_everything_after_the_leading_blocks() -> None:
    shared = list(range(1000, 1300))
    assert prefix_key(shared + [1, 2], block_tokens=16, max_tokens=256) == \
        prefix_key(shared + [7, 8, 9], block_tokens=16, max_tokens=256)
    assert prefix_key([5] + shared, block_tokens=16, max_tokens=256) != \
        prefix_key(shared, block_tokens=16, max_tokens=256)
    # Partial last block is left out, so a growing prompt keeps its key within a block.
    assert prefix_key(list(range(40)), block_tokens=16, max_tokens=256) == \
        prefix_key(list(range(47)), block_tokens=16, max_tokens=256)


def test_shared_prefixes_stick_to_one_engine_and_spread_over_all() -> None:
    r = router(RoutingPolicy.PREFIX)
    rng = random.Random(0)
    homes = set()
    for _ in range(30):
        prefix = [rng.randrange(50_000) for _ in range(300)]
        chosen = {r.choose(idle(), prefix + [rng.randrange(50_000)], None).address for _ in range(5)}
        assert len(chosen) == 1
        homes |= chosen
    assert homes == set(ENGINES)


def test_losing_an_engine_moves_only_the_keys_it_held() -> None:
    rng = random.Random(1)
    keys = [bytes(rng.randrange(256) for _ in range(16)) for _ in range(300)]
    before = {k: rendezvous_order(k, ENGINES)[0] for k in keys}
    after = {k: rendezvous_order(k, ENGINES[:2])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == ENGINES[2] for k in moved)


def test_load_bound_spills_a_hot_prefix_to_other_engines() -> None:
    for slack, most in ((0, 13), (4, 17)):
        r = router(RoutingPolicy.PREFIX, load_bound=1.25, load_slack=slack)
        prompt = list(range(300))
        loads = collections.Counter[str]()
        for _ in range(30):
            chosen = r.choose([Candidate(a, loads[a]) for a in ENGINES], prompt, None)
            loads[chosen.address] += 1
        # Bounded to 1.25x the fair share (10), rounded up, plus the slack.
        assert max(loads.values()) == most and len(loads) >= 2


def test_slack_keeps_a_few_concurrent_requests_of_one_prefix_together() -> None:
    r = router(RoutingPolicy.PREFIX, load_slack=4)
    prompt = list(range(300))
    loads = collections.Counter[str]()
    for _ in range(5):
        loads[r.choose([Candidate(a, loads[a]) for a in ENGINES], prompt, None).address] += 1
    assert sorted(loads.values()) == [5]


def test_session_policy_follows_the_session_not_the_prompt() -> None:
    r = router(RoutingPolicy.SESSION)
    rng = random.Random(2)
    chosen = {r.choose(idle(), [rng.randrange(50_000) for _ in range(50)], "session-42").address
              for _ in range(10)}
    assert len(chosen) == 1


def test_least_loaded_and_round_robin() -> None:
    least = router(RoutingPolicy.LEAST_LOADED)
    loads = [Candidate(ENGINES[0], 3), Candidate(ENGINES[1], 1), Candidate(ENGINES[2], 2)]
    assert least.choose(loads, [1, 2, 3], None).address == ENGINES[1]
    rr = router(RoutingPolicy.ROUND_ROBIN)
    assert [rr.choose(idle(), [1], None).address for _ in range(6)] == sorted(ENGINES) * 2


def test_breaker_ejects_after_repeated_failures_and_a_serving_probe_restores() -> None:
    breaker = CircuitBreaker(failure_threshold=3, open_s=5.0)
    breaker.record_failure(now=0)
    breaker.record_success()
    breaker.record_failure(now=1)
    breaker.record_failure(now=2)
    assert not breaker.is_open
    breaker.record_failure(now=3)
    assert breaker.is_open and not breaker.is_due_for_probe(now=7)
    assert breaker.is_due_for_probe(now=8.5)
    breaker.record_probe(False, now=8.5)
    assert breaker.is_open and not breaker.is_due_for_probe(now=10)
    breaker.record_probe(True, now=14)
    assert not breaker.is_open
