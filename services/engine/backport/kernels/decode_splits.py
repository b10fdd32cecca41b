"""How many splits a sparse MLA decode cuts each token's slot lists into.

Both decodes (the CUDA one and the Triton one) take the count that a model of the busiest
SM says is cheapest, each with its own figures. Filling one wave of resident blocks is not
enough: on 112 SMs the CUDA decode's B=64 H=64 takes 256 blocks at one split, more than the
224 held at once, and ran 0.278 ms against 0.198 at four splits (H200 in sm80 mode).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class SplitCostModel:
    """A launch's time in steps of one block alone on an SM, fitted per decode to CUDA-graph
    times of every split count on green contexts of 132, 112 and 88 SMs
    (docs/kernels-history.md, `bench/kernels.py --sweep-splits`)."""

    keys_per_step: int
    lists_share_steps: bool  # both lists run as one (CUDA), or each in steps of its own
    fixed_steps_per_block: float  # a block's start (q, lengths, slots, first rows) and partials
    shared_sm_speedup: float  # an SM runs its blocks together this much faster than one alone
    combine_steps_per_split: float  # the combine loops over the splits padded to a power of 2
    max_splits: int

    def block_steps(self, list_width: int, extra_list_width: int, splits: int) -> int:
        """Steps of the longest block: its share of both lists."""
        keys, extra_keys = triton.cdiv(list_width, splits), triton.cdiv(extra_list_width, splits)
        if self.lists_share_steps:
            return triton.cdiv(keys + extra_keys, self.keys_per_step)
        return triton.cdiv(keys, self.keys_per_step) + triton.cdiv(extra_keys, self.keys_per_step)

    def cost(self, programs: int, list_width: int, extra_list_width: int, splits: int,
             sm_count: int, blocks_per_sm: int) -> float:
        """The time of `programs` (token, head block) pairs of `splits` splits each."""
        block = self.block_steps(list_width, extra_list_width, splits) + self.fixed_steps_per_block
        # Blocks spread evenly over the SMs, and the busiest SM sets the pace: it runs its
        # blocks as many at a time as it holds, and a last lone one at single speed.
        per_sm = triton.cdiv(programs * splits, sm_count)
        rounds, rest = divmod(per_sm, blocks_per_sm)
        busiest = rounds * blocks_per_sm * block / self.shared_sm_speedup
        busiest += rest * block / (self.shared_sm_speedup if rest > 1 else 1.0)
        return busiest + self.combine_steps_per_split * triton.next_power_of_2(splits)

    def cheapest_splits(self, programs: int, list_width: int, extra_list_width: int,
                        sm_count: int, blocks_per_sm: int) -> int:
        """The split count of least `cost` (the fewest of equal cost), 1..max_splits."""
        return _cheapest_splits(self, programs, list_width, extra_list_width, sm_count,
                                blocks_per_sm)


@functools.lru_cache(maxsize=4096)
def _cheapest_splits(model: SplitCostModel, programs: int, list_width: int,
                     extra_list_width: int, sm_count: int, blocks_per_sm: int) -> int:
    return min(range(1, model.max_splits + 1), key=lambda splits: model.cost(
        programs, list_width, extra_list_width, splits, sm_count, blocks_per_sm))
