"""A choice's reasoning tokens, for `completion_tokens_details.reasoning_tokens`.

Counted by token id, as vLLM counts them: the output tokens between the reasoning format's
start and end markers, the markers not counted. Where the prompt opened the reasoning
(thinking mode), the count starts at the first output token; vLLM's count needs the start
marker in the output and gives 0 there. Only formats whose markers are one token each are
counted. A tool call that starts inside the reasoning ends it for the output parser but not
here: its tokens count until the end marker. Once the reasoning has ended, a start marker no
longer opens it: the answer is talking about the tag, as the output parser reads it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.gateway.parsing.formats import ReasoningFormat
from services.tokenizer.client import TokenizerClient


@dataclass(frozen=True, slots=True)
class ReasoningMarkerIds:
    start: int
    end: int

    @classmethod
    async def of(cls, reasoning: ReasoningFormat, tokenizer: TokenizerClient) -> ReasoningMarkerIds | None:
        """The markers' token ids in the served tokenizer; None where either is several tokens."""
        start = await tokenizer.encode(reasoning.start, add_special_tokens=False)
        end = await tokenizer.encode(reasoning.end, add_special_tokens=False)
        if len(start) != 1 or len(end) != 1:
            return None
        return cls(start[0], end[0])


class ReasoningTokenCounter:
    """Follows one choice's output tokens in and out of its reasoning."""

    def __init__(self, markers: ReasoningMarkerIds, *, thinking: bool) -> None:
        self.markers = markers
        self.in_reasoning = thinking
        self.count = 0
        self._has_reasoning_ended = False

    def feed(self, token_ids: Iterable[int]) -> int:
        for token_id in token_ids:
            if token_id == self.markers.start:
                self.in_reasoning = self.in_reasoning or not self._has_reasoning_ended
            elif token_id == self.markers.end:
                self._has_reasoning_ended = self._has_reasoning_ended or self.in_reasoning
                self.in_reasoning = False
            elif self.in_reasoning:
                self.count += 1
        return self.count
