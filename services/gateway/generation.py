"""One engine request seen as detokenized, stop-checked text deltas per choice."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from backport.v1 import common_pb2
from backport.v1 import engine_pb2 as pb
from services.engine.client import EngineClient
from services.gateway.dispatch import EngineRoute
from services.gateway.errors import (EngineFailedError, InvalidRequestError, ServiceUnavailableError,
                                     tokenizer_failure)
from services.gateway.reasoning_tokens import ReasoningTokenCounter
from services.gateway.request_context import current_request_context
from services.gateway.stop_strings import StopStringMatcher
from services.tokenizer.client import MAX_CHARACTER_TOKENS, TokenizerClient
from services.tokenizer.detokenize_stream import SequenceDetokenizer
from services.tokenizer.errors import TokenizerTimeoutError

logger = logging.getLogger(__name__)

# vLLM writes a logprob of -inf, which JSON cannot hold, as this.
MIN_LOGPROB = -9999.0

# The engine's GenerateError.field for an output constraint it cannot compile.
ENGINE_CONSTRAINT_FIELD = "sampling.structured_output"
ENGINE_SAMPLING_PREFIX = "sampling."

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    # The top alternatives, most likely first; the token itself among them where it ranks.
    top: list[TopLogprob]


@dataclass(frozen=True, slots=True)
class RankedLogprob:
    token_id: int
    token: str
    logprob: float
    # 1 for the most likely token at its position.
    rank: int


@dataclass(frozen=True, slots=True)
class PromptTokenLogprobs:
    """One prompt token's text and its candidates as vLLM lists them: the prompt's own token
    first, then the top alternatives (the prompt's token among them only once); None for the
    prompt's first token, which nothing precedes."""

    token_id: int
    token: str
    candidates: list[RankedLogprob] | None


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Set on the choice's last delta: "stop", "length" or "abort".
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice (None for EOS or length).
    stop_reason: str | int | None = None


@dataclass(slots=True)
class CollectedChoice:
    """One choice, whole, for a non-streamed response."""

    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass(slots=True)
class UsageCounts:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens_by_choice: dict[Any, int] = field(default_factory=dict)
    # Off where no reasoning parser is on: then there is no count to report.
    counts_reasoning: bool = False
    reasoning_tokens_by_choice: dict[Any, int] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion_tokens_by_choice.values())

    @property
    def reasoning_tokens(self) -> int | None:
        if not self.counts_reasoning:
            return None
        return sum(self.reasoning_tokens_by_choice.values())


class Generation:
    """Runs one `Generate` call; iterating `deltas()` drives it and closing it aborts it.

    `constraint_param` is the request field that asked for the output constraint, if any:
    the engine's errors about the constraint name it."""

    def __init__(self, route: EngineRoute, tokenizer: TokenizerClient, request: pb.GenerateRequest,
                 *, stop_strings: list[str], skip_special_tokens: bool,
                 include_stop_str: bool = False,
                 reasoning_counters: list[ReasoningTokenCounter] | None = None,
                 constraint_param: str | None = None) -> None:
        self.route = route
        self.tokenizer = tokenizer
        self.request = request
        self.num_choices = max(1, request.sampling.n)
        self.usage = UsageCounts(prompt_tokens=len(request.prompt_token_ids),
                                 counts_reasoning=reasoning_counters is not None)
        self._reasoning_counters = reasoning_counters
        self._constraint_param = constraint_param
        self._stop_strings = stop_strings
        self._include_stop_str = include_stop_str
        self._skip_special_tokens = skip_special_tokens
        # Set from the chunk that carries them, the first, when the request asked for them.
        self.prompt_logprobs: list[PromptTokenLogprobs] | None = None
        self._detokenizers: dict[int, SequenceDetokenizer] = {}
        self._matchers: dict[int, StopStringMatcher] = {}
        # Each choice's last sampled tokens: a logprob token's text may finish their characters.
        self._sampled_tails: dict[int, list[int]] = {}
        self._call: grpc.aio.UnaryStreamCall | None = None
        # Engine aborts of choices a stop string ended while their siblings run on.
        self._choice_aborts: set[asyncio.Task[None]] = set()
        self._first: pb.GenerateResponse | None = None
        self._started_at = current_request_context().started_at
        self._last_tokens_at: float | None = None

    async def start(self) -> None:
        """Sends the request and waits for its first response, so that a request the engine
        refuses fails before any HTTP response has begun; until then a failing engine is
        replaced by another."""
        opened = await self.route.open(self.request)
        self._call = opened.call
        first = opened.first
        if first is not None and first.WhichOneof("response") == "error":
            self._call.cancel()
            raise _request_error(first.error, self._constraint_param)
        self._first = first

    def cancel(self) -> None:
        """Aborts a started generation that will not be read (another of its batch failed)."""
        if self._call is not None:
            self._call.cancel()

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        if self._call is None:
            await self.start()
        assert self._call is not None
        finished: set[int] = set()
        response = self._first
        try:
            while response is not None:
                is_chunk = response.WhichOneof("response") == "chunk"
                try:
                    delta = await (self._on_chunk(response.chunk, finished) if is_chunk
                                   else self._on_complete(response.complete, finished))
                except (grpc.aio.AioRpcError, TokenizerTimeoutError) as error:
                    # Only the tokenizer service is called there. As a GatewayError it
                    # ends a started stream with an error event, as an engine failure does.
                    raise tokenizer_failure(error) from error
                if delta is not None:
                    if delta.finish_reason is not None:
                        finished.add(delta.index)
                    yield delta
                    if len(finished) == self.num_choices:
                        break
                    if is_chunk and delta.finish_reason is not None:
                        # A stop string ended the choice here; the engine would decode it on
                        # to its token limit while its siblings run.
                        self._abort_choice(delta.index)
                response = await self._read()
        finally:
            # Cancelling the call is how an early stop (stop string, client gone) aborts in vLLM.
            self._call.cancel()
            for detokenizer in self._detokenizers.values():
                detokenizer.close()

    def _abort_choice(self, index: int) -> None:
        engine = self.route.engine
        if engine is None:
            return
        task = asyncio.create_task(self._send_choice_abort(engine.client, index))
        self._choice_aborts.add(task)
        task.add_done_callback(self._choice_aborts.discard)

    async def _send_choice_abort(self, client: EngineClient, index: int) -> None:
        try:
            await client.abort(self.request.request_id, [index])
        except grpc.aio.AioRpcError as error:
            # Only compute is lost: the choice's further tokens are dropped here anyway.
            logger.info("engine abort of choice %d of %s failed: %s", index,
                        self.request.request_id, error.code().name)

    async def collect(self) -> list[CollectedChoice]:
        """Runs the generation to its end and returns every choice, in index order."""
        texts: list[list[str]] = [[] for _ in range(self.num_choices)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(self.num_choices)]
        last_deltas: list[ChoiceDelta | None] = [None] * self.num_choices
        async for delta in self.deltas():
            texts[delta.index].append(delta.text)
            logprobs[delta.index] += delta.logprobs
            if delta.finish_reason is not None:
                last_deltas[delta.index] = delta
        return [CollectedChoice("".join(t), lp, last.finish_reason if last else None,
                                last.stop_reason if last else None)
                for t, lp, last in zip(texts, logprobs, last_deltas, strict=True)]

    async def _read(self) -> pb.GenerateResponse | None:
        assert self._call is not None
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as error:
            self.route.record_stream_failure()
            raise ServiceUnavailableError(
                f"engine {self.route.address} failed: {error.code().name}") from error
        if response is grpc.aio.EOF:
            return None
        if response.WhichOneof("response") == "error":
            raise _request_error(response.error, self._constraint_param)
        return response

    async def _on_chunk(self, chunk: pb.GenerateChunk, finished: set[int]) -> ChoiceDelta | None:
        if chunk.index in finished:
            return None
        if chunk.prompt_logprobs or (self.prompt_logprobs is None
                                     and self.request.sampling.HasField("prompt_logprobs")):
            self.prompt_logprobs = await self._prompt_logprobs(list(chunk.prompt_logprobs))
        self._count(chunk.index, chunk.completion_tokens, chunk.cached_prompt_tokens)
        token_ids = list(chunk.token_ids)
        if token_ids:
            self._observe_tokens(len(token_ids))
        token_texts = await self._token_texts(chunk.index, token_ids)
        num_tokens_before = chunk.completion_tokens - len(token_ids)
        check = self._matcher(chunk.index).feed(
            "".join(token_texts),
            num_protected_chars=self._num_min_token_chars(token_texts, num_tokens_before))
        # A chunk can hold tokens generated after the one that completed a stop string (the
        # engine merges outputs when it runs behind); as in vLLM, they are neither counted nor
        # given logprobs.
        num_kept = _num_tokens_reaching(token_texts, check.stop_end) if check.stopped else len(token_ids)
        self.usage.completion_tokens_by_choice[chunk.index] -= len(token_ids) - num_kept
        if self._reasoning_counters is not None:
            counter = self._reasoning_counters[chunk.index]
            self.usage.reasoning_tokens_by_choice[chunk.index] = counter.feed(token_ids[:num_kept])
        entries = list(chunk.logprobs[:num_kept])
        logprobs = await self._logprobs(chunk.index, entries) if entries else []
        if check.stopped:
            return ChoiceDelta(chunk.index, check.text, logprobs, finish_reason="stop",
                               stop_reason=check.stop)
        if check.text or logprobs:
            return ChoiceDelta(chunk.index, check.text, logprobs)
        return None

    async def _on_complete(self, complete: pb.GenerateComplete,
                           finished: set[int]) -> ChoiceDelta | None:
        if complete.index in finished:
            return None
        self._count(complete.index, complete.completion_tokens, complete.cached_prompt_tokens)
        tail = self._matcher(complete.index).flush()
        # Engines from before `stopping_token_id` name stop tokens alone, not EOS.
        stopping_token_id = (complete.stopping_token_id if complete.HasField("stopping_token_id")
                             else complete.stop_token_id if complete.HasField("stop_token_id")
                             else None)
        if self._include_stop_str and stopping_token_id is not None:
            # As vLLM: the text of the EOS or stop token that ended the choice ends the output
            # when stops are included in it (an EOS's only where special tokens are shown); the
            # engine leaves the token out of the chunks.
            tail += await self._detokenizer(complete.index).step([stopping_token_id])
        # As vLLM: that token's logprob is the choice's last, whether or not its text shows.
        logprobs = (await self._logprobs(complete.index, [complete.stopping_token_logprob])
                    if complete.HasField("stopping_token_logprob") else [])
        return ChoiceDelta(complete.index, tail, logprobs,
                           finish_reason=FINISH_REASONS.get(complete.finish_reason, "stop"),
                           stop_reason=(complete.stop_token_id if complete.HasField("stop_token_id")
                                        else None))

    def _num_min_token_chars(self, token_texts: list[str], num_tokens_before: int) -> int:
        """How many characters of a chunk's text belong to the choice's first `min_tokens`
        tokens, where vLLM lets no stop string end."""
        num_protected_tokens = self.request.sampling.min_tokens - num_tokens_before
        if num_protected_tokens <= 0:
            return 0
        return sum(len(text) for text in token_texts[:num_protected_tokens])

    async def _token_texts(self, index: int, token_ids: list[int]) -> list[str]:
        """The chunk's text, split by token where a stop string may need to know which
        token completed it."""
        if not token_ids:
            return []
        detokenizer = self._detokenizer(index)
        if self._stop_strings and len(token_ids) > 1:
            return await detokenizer.step_each(token_ids)
        return [await detokenizer.step(token_ids)]

    def _observe_tokens(self, num_tokens: int) -> None:
        now = time.monotonic()
        metrics = self.route.metrics
        if self._last_tokens_at is None:
            metrics.time_to_first_token.observe(now - self._started_at)
        else:
            metrics.inter_token_latency.observe((now - self._last_tokens_at) / num_tokens)
        self._last_tokens_at = now

    def _count(self, index: int, completion_tokens: int, cached_tokens: int) -> None:
        self.usage.completion_tokens_by_choice[index] = completion_tokens
        self.usage.cached_tokens = cached_tokens

    def _detokenizer(self, index: int) -> SequenceDetokenizer:
        if index not in self._detokenizers:
            self._detokenizers[index] = self.tokenizer.detokenizer(
                skip_special_tokens=self._skip_special_tokens,
                prompt_token_ids=self.request.prompt_token_ids)
        return self._detokenizers[index]

    def _matcher(self, index: int) -> StopStringMatcher:
        if index not in self._matchers:
            self._matchers[index] = StopStringMatcher(self._stop_strings,
                                                      include_stop=self._include_stop_str)
        return self._matchers[index]

    async def _logprobs(self, index: int, entries: list[pb.TokenLogprob]) -> list[TokenLogprob]:
        tail = self._sampled_tails.setdefault(index, [])
        positions = []  # (the tokens sampled before, the candidates), as logprob texts need
        for entry in entries:
            positions.append((tail[-MAX_CHARACTER_TOKENS:],
                              [entry.token_id, *(t.token_id for t in entry.top)]))
            tail.append(entry.token_id)
        del tail[:-MAX_CHARACTER_TOKENS]
        texts = await self.tokenizer.logprob_token_texts(positions)
        return [TokenLogprob(entry.token_id, token, entry.logprob,
                             [TopLogprob(t.token_id, text, t.logprob)
                              for t, text in zip(entry.top, top, strict=True)])
                for entry, (token, *top) in zip(entries, texts, strict=True)]

    async def _prompt_logprobs(self, entries: list[pb.TokenLogprob]) -> list[PromptTokenLogprobs]:
        """The engine's entries (the prompt's second token on) with the prompt's first token."""
        prompt = self.request.prompt_token_ids
        # Keyed by token id, vLLM's order: the prompt token first, a repeat keeps its place.
        candidates = [{entry.token_id: (entry.logprob, entry.rank)} | {t.token_id: (t.logprob, t.rank)
                                                                       for t in entry.top}
                      for entry in entries]
        # As in vLLM, a position's context is the prompt tokens scored before it, from the
        # second on; the first, unscored, is decoded alone.
        texts = await self.tokenizer.logprob_token_texts(
            [(prompt[max(1, k - MAX_CHARACTER_TOKENS):k], list(position))
             for k, position in enumerate(candidates, start=1)])
        scored = [PromptTokenLogprobs(entry.token_id, position_texts[0], [
                      RankedLogprob(token_id, text, logprob, rank)
                      for (token_id, (logprob, rank)), text in zip(position.items(), position_texts, strict=True)])
                  for entry, position, position_texts in zip(entries, candidates, texts, strict=True)]
        [first_text] = await self.tokenizer.token_texts([prompt[0]])
        return [PromptTokenLogprobs(prompt[0], first_text, None), *scored]


def prompt_logprobs_json(prompt_logprobs: list[PromptTokenLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else
    {token id: {logprob, rank, decoded_token}}, -inf written as -9999.0."""
    return [None if entry.candidates is None else {
        str(c.token_id): {"logprob": finite_logprob(c.logprob), "rank": c.rank, "decoded_token": c.token}
        for c in entry.candidates} for entry in prompt_logprobs]


def finite_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def shown_token(token_id: int, text: str, *, as_token_id: bool) -> str:
    """A logprob token as vLLM writes it: its text, or with `return_tokens_as_token_ids`
    "token_id:<id>" (for clients that need the token whole where its text is a piece)."""
    return f"token_id:{token_id}" if as_token_id else text


def _num_tokens_reaching(token_texts: list[str], text_end: int) -> int:
    """How many of the tokens it takes for their texts to reach `text_end` characters."""
    num_chars = 0
    for num_tokens, text in enumerate(token_texts, start=1):
        num_chars += len(text)
        if num_chars >= text_end:
            return num_tokens
    return len(token_texts)


def _request_error(error: pb.GenerateError, constraint_param: str | None) -> Exception:
    if error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT:
        if error.field == ENGINE_CONSTRAINT_FIELD and constraint_param is not None:
            # The client wrote the field that asked for the constraint, not the engine's.
            return InvalidRequestError(f"{constraint_param}: {error.message}", param=constraint_param)
        if error.field.startswith(ENGINE_SAMPLING_PREFIX) and error.field != ENGINE_CONSTRAINT_FIELD:
            # The engine's other sampling fields bear the names of the request's.
            return InvalidRequestError(error.message,
                                       param=error.field.removeprefix(ENGINE_SAMPLING_PREFIX))
        return InvalidRequestError(error.message)
    if error.code == common_pb2.ERROR_CODE_UNAVAILABLE:
        return ServiceUnavailableError(error.message)
    return EngineFailedError(error.message)
