"""Every sequence's incremental detokenization on one stream to the tokenizer service.

A stream a sequence cost a gRPC message each way per chunk of tokens; at 64 concurrent
streams those messages were the gateway's largest CPU cost (docs/bench.md). Here the steps
that sequences queue while a message is being written go out together in the next one.

A sequence's state lives in the service and goes with a lost stream (the service restarted,
say). A sequence then opens again on the next stream with every token it has stepped, whose
text is already the caller's, and steps on: its output continues exactly where it stopped.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from backport.v1 import tokenizer_pb2 as pb
from backport.v1 import tokenizer_pb2_grpc
from services.tokenizer.errors import TokenizerTimeoutError

# A step's error code as the status it names (0, OK, names none: UNKNOWN then).
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode if code != grpc.StatusCode.OK}
# Enough of the prompt's end that a sequence's first generated token decodes as a continuation;
# the whole prompt would cost a long prompt's worth of decoding per choice.
NUM_PROMPT_TOKENS_TO_PRIME = 8
# How long a step tries again on new streams while the service is away, without a client
# deadline to bound it (with one, the deadline does).
RESUME_WINDOW_S = 30.0
# Between tries: the channel fails a call at once while it reconnects (within 5 s,
# services/mesh/channels.py), so each try is quick.
FIRST_RETRY_PAUSE_S = 0.05
MAX_RETRY_PAUSE_S = 1.0


class StreamLostError(grpc.aio.AioRpcError):
    """The stream ended under a step: the service went away, restarted or closed it. The step
    may be tried again on a new stream."""


class _MalformedReply(Exception):
    """The service answered what was never asked: trying again would get the same."""


@dataclass
class _Exchange:
    """One caller's steps, answered together."""
    future: asyncio.Future[list[str]]
    num_steps: int


class DetokenizeStream:
    """The `DetokenizeSequences` stream of one client, opened on first use and again after a
    loss. A loss fails the steps in flight with `StreamLostError`; their sequences try them
    again."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub, *, timeout_s: float | None) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self.resume_window_s = timeout_s if timeout_s is not None else RESUME_WINDOW_S
        self.closed = False
        self._sequence_ids = itertools.count(1)
        # Counts lost streams: a sequence opened on an earlier one has no state left.
        self.incarnation = 0
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._queued_steps: list[pb.SequenceStep] = []
        self._queued_exchanges: list[_Exchange] = []
        self._queued_closes: list[int] = []
        self._has_queued = asyncio.Event()
        # Per message written and not yet answered, the exchanges it carries.
        self._written: deque[list[_Exchange]] = deque()

    def sequence(self, *, skip_special_tokens: bool,
                 prompt_token_ids: Sequence[int]) -> SequenceDetokenizer:
        return SequenceDetokenizer(self, next(self._sequence_ids),
                                   skip_special_tokens=skip_special_tokens,
                                   prompt_token_ids=prompt_token_ids)

    async def exchange(self, steps: list[pb.SequenceStep]) -> list[str]:
        """The text of each step; they go out in one message, with whatever else is queued."""
        if self.closed:
            raise _unavailable("the tokenizer client closed")
        if self._call is None:
            self._open()
        exchange = _Exchange(asyncio.get_running_loop().create_future(), len(steps))
        self._queued_steps += steps
        self._queued_exchanges.append(exchange)
        self._has_queued.set()
        try:
            # A caller that gives up cancels its future; its reply is then passed over.
            async with asyncio.timeout(self._timeout_s):
                return await exchange.future
        except TimeoutError:
            raise TokenizerTimeoutError(self._timeout_s) from None

    def close_sequence(self, sequence_id: int, incarnation: int) -> None:
        if self._call is None or incarnation != self.incarnation:
            return
        self._queued_closes.append(sequence_id)
        self._has_queued.set()

    async def close(self) -> None:
        self.closed = True
        if self._call is not None:
            tasks = self._tasks
            self._lose(self._call, _unavailable("the tokenizer client closed"), resumable=False)
            await asyncio.gather(*tasks, return_exceptions=True)

    def _open(self) -> None:
        call = self._stub.DetokenizeSequences()
        self._call = call
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write_queued(call)),
                       loop.create_task(self._read_replies(call))]

    async def _write_queued(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                await self._has_queued.wait()
                self._has_queued.clear()
                request = pb.DetokenizeSequencesRequest(steps=self._queued_steps,
                                                        closed_sequence_ids=self._queued_closes)
                self._written.append(self._queued_exchanges)
                self._queued_steps, self._queued_exchanges, self._queued_closes = [], [], []
                await call.write(request)
        except asyncio.InvalidStateError:
            # The stream ended (the service went away): the reader gets its status.
            pass
        except Exception as error:
            self._lose(call, _as_status(error), resumable=isinstance(error, grpc.aio.AioRpcError))

    async def _read_replies(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise _unavailable("the tokenizer service closed the detokenize stream")
                if not self._written:
                    raise _MalformedReply("the tokenizer service answered a message never sent")
                # Answered before it leaves the queue: a bad reply fails it with the rest.
                self._answer(self._written[0], reply.texts)
                self._written.popleft()
        except Exception as error:
            # Whatever ends the reader fails the stream: its sequences would wait forever.
            self._lose(call, _as_status(error), resumable=isinstance(error, grpc.aio.AioRpcError))

    @staticmethod
    def _answer(exchanges: list[_Exchange], texts: Sequence[pb.SequenceText]) -> None:
        num_steps = sum(exchange.num_steps for exchange in exchanges)
        if len(texts) != num_steps:
            raise _MalformedReply(f"the tokenizer service answered {len(texts)} of {num_steps} steps")
        start = 0
        for exchange in exchanges:
            answered = texts[start:start + exchange.num_steps]
            start += exchange.num_steps
            if exchange.future.done():
                continue
            failed = next((text for text in answered if text.error), None)
            if failed is not None:
                code = STATUS_CODES.get(failed.error_code, grpc.StatusCode.UNKNOWN)
                exchange.future.set_exception(_error(code, failed.error))
            else:
                exchange.future.set_result([text.text for text in answered])

    def _lose(self, call: grpc.aio.StreamStreamCall, error: grpc.aio.AioRpcError, *,
              resumable: bool) -> None:
        if call is not self._call:
            return
        self._call = None
        self.incarnation += 1
        call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        unanswered = [*itertools.chain.from_iterable(self._written), *self._queued_exchanges]
        self._written.clear()
        self._queued_steps, self._queued_exchanges, self._queued_closes = [], [], []
        failure = StreamLostError if resumable else grpc.aio.AioRpcError
        for exchange in unanswered:
            if not exchange.future.done():
                # One instance per caller, as each raises it with its own traceback.
                exchange.future.set_exception(failure(error.code(), grpc.aio.Metadata(),
                                                      grpc.aio.Metadata(), error.details() or ""))


class SequenceDetokenizer:
    """One sequence's incremental detokenization, on its client's shared stream.

    The sequence starts with the prompt's last tokens, whose text is dropped: sentencepiece-style
    decoders strip the leading space of a sequence's first word, so a completion decoded on its
    own would lose the space it starts with (" Paris" after "The capital of France is"). vLLM's
    detokenizer is primed with the prompt for the same reason.

    A step that loses its stream is tried again on a new one, within the stream's resume window:
    the service decodes token by token, so the tokens stepped so far, stepped again, make the
    text already returned, which is dropped.
    """

    def __init__(self, stream: DetokenizeStream, sequence_id: int, *, skip_special_tokens: bool,
                 prompt_token_ids: Sequence[int]) -> None:
        self._stream = stream
        self._id = sequence_id
        self._skip_special_tokens = skip_special_tokens
        self._prompt_tail = list(prompt_token_ids[-NUM_PROMPT_TOKENS_TO_PRIME:])
        self._stepped: list[int] = []
        # The stream incarnation the sequence is open on; None until its first step.
        self._incarnation: int | None = None

    async def step(self, token_ids: list[int]) -> str:
        """The text these tokens make final."""
        return (await self._exchange([token_ids]))[0]

    async def step_each(self, token_ids: list[int]) -> list[str]:
        """The text each token makes final, in one round trip: what a stop string needs to
        tell which token completed it."""
        return await self._exchange([[token_id] for token_id in token_ids])

    async def _exchange(self, token_id_lists: list[list[int]]) -> list[str]:
        resume_by = time.monotonic() + self._stream.resume_window_s
        pause_s = FIRST_RETRY_PAUSE_S
        while True:
            try:
                texts = await self._exchange_on_current_stream(token_id_lists)
            except StreamLostError:
                if self._stream.closed or time.monotonic() + pause_s >= resume_by:
                    raise
                await asyncio.sleep(pause_s)
                pause_s = min(2 * pause_s, MAX_RETRY_PAUSE_S)
                continue
            self._stepped += itertools.chain.from_iterable(token_id_lists)
            return texts

    async def _exchange_on_current_stream(self, token_id_lists: list[list[int]]) -> list[str]:
        steps = [pb.SequenceStep(sequence_id=self._id, token_ids=ids) for ids in token_id_lists]
        opening = []
        if self._incarnation != self._stream.incarnation:
            opening.append(pb.SequenceStep(sequence_id=self._id, token_ids=self._prompt_tail,
                                           open=True,
                                           skip_special_tokens=self._skip_special_tokens))
            if self._stepped:
                opening.append(pb.SequenceStep(sequence_id=self._id, token_ids=self._stepped))
            self._incarnation = self._stream.incarnation
        texts = await self._stream.exchange(opening + steps)
        return texts[len(opening):]

    def close(self) -> None:
        if self._incarnation is not None:
            self._stream.close_sequence(self._id, self._incarnation)


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    # The status callers handle for any failed tokenizer call; one instance per caller, as
    # each raises it with its own traceback.
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return _error(grpc.StatusCode.UNAVAILABLE, details)


def _as_status(error: Exception) -> grpc.aio.AioRpcError:
    if isinstance(error, grpc.aio.AioRpcError):
        return error
    if isinstance(error, _MalformedReply):
        return _unavailable(str(error))
    return _unavailable(f"the detokenize stream failed: {error!r}")
