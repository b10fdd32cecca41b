"""Which engine serves a request: prefix affinity, session affinity, least loaded, round robin.

Affinity uses rendezvous hashing (each engine scores `hash(key, address)`, the highest wins),
so adding or losing an engine moves only the keys it wins or held. A load bound keeps one hot
key from swamping its engine: an engine is skipped while it holds more than `load_bound` times
its fair share of the gateway's in-flight requests plus `load_slack` (consistent hashing with
bounded loads; the slack keeps a few concurrent requests of one prefix together at low load,
where the cache hit is worth more than perfect balance).
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass


class RoutingPolicy(enum.StrEnum):
    PREFIX = "prefix"
    SESSION = "session"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class Candidate:
    address: str
    num_in_flight: int


def prefix_key(token_ids: Sequence[int], *, block_tokens: int, max_tokens: int) -> bytes:
    """Hash of the prompt's leading whole blocks (at most `max_tokens` tokens); prompts shorter
    than one block hash whole. Blocks match how vLLM's prefix cache shares KV."""
    num_blocks = min(len(token_ids), max_tokens) // block_tokens
    leading = token_ids[:num_blocks * block_tokens] if num_blocks else token_ids
    return hashlib.blake2b(array("I", leading).tobytes(), digest_size=16).digest()


def session_affinity_key(session_key: str) -> bytes:
    return hashlib.blake2b(session_key.encode(), digest_size=16).digest()


def rendezvous_order(key: bytes, addresses: Sequence[str]) -> list[str]:
    def score(address: str) -> bytes:
        return hashlib.blake2b(key + address.encode(), digest_size=8).digest()

    return sorted(addresses, key=score, reverse=True)


def bounded_choice(key: bytes, candidates: Sequence[Candidate], load_bound: float,
                   load_slack: int = 0) -> Candidate:
    """The highest-scoring candidate whose load stays within the bound after taking this one."""
    total = sum(c.num_in_flight for c in candidates) + 1
    capacity = math.ceil(load_bound * total / len(candidates)) + load_slack
    by_address = {c.address: c for c in candidates}
    order = rendezvous_order(key, list(by_address))
    for address in order:
        if by_address[address].num_in_flight + 1 <= capacity:
            return by_address[address]
    return by_address[order[0]]  # unreachable: the average is below the capacity


class Router:
    """Chooses among routable engines; holds only the round-robin cursor."""

    def __init__(self, policy: RoutingPolicy, *, block_tokens: int, affinity_max_tokens: int,
                 load_bound: float, load_slack: int = 0) -> None:
        self.policy = policy
        self.load_slack = load_slack
        self.block_tokens = block_tokens
        self.affinity_max_tokens = affinity_max_tokens
        self.load_bound = load_bound
        self._next = 0

    def choose(self, candidates: Sequence[Candidate], prompt_token_ids: Sequence[int],
               session_key: str | None) -> Candidate:
        if not candidates:
            raise ValueError("no candidates")
        if len(candidates) == 1:
            return candidates[0]
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            ordered = sorted(candidates, key=lambda c: c.address)
            self._next += 1
            return ordered[(self._next - 1) % len(ordered)]
        if self.policy is RoutingPolicy.LEAST_LOADED:
            fewest = min(c.num_in_flight for c in candidates)
            return random.choice([c for c in candidates if c.num_in_flight == fewest])
        if self.policy is RoutingPolicy.SESSION and session_key:
            key = session_affinity_key(session_key)
        else:
            key = prefix_key(prompt_token_ids, block_tokens=self.block_tokens,
                             max_tokens=self.affinity_max_tokens)
        return bounded_choice(key, candidates, self.load_bound, self.load_slack)
