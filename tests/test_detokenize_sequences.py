"""`DetokenizeSequences`: every sequence of a tokenizer client on one stream, over real gRPC to
the real tokenizer servicer run in the test's own process, so that the test can count the
messages it reads and hold one back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from backport.v1 import tokenizer_pb2 as pb
from backport.v1 import tokenizer_pb2_grpc
from services.tokenizer.client import TokenizerClient
from services.tokenizer.core import TokenizerCore
from services.tokenizer.errors import TokenizerTimeoutError
from services.tokenizer.servicer import TokenizerServicer
from tests.conftest import free_port

PROMPT = "The capital of France is"
# Characters of two to four UTF-8 bytes, which byte-level tokens split.
COMPLETIONS = [" Paris, and Tokyo (東京) is Japan's.", " 🎉 a party — ünïcödé!",
               " plain words, one after another", " 1234567 + 89 = ?"]
# The message holding a step with this token is read only after this long.
HELD_TOKEN_ID = 0
HOLD_S = 1.5


class ObservedServicer(TokenizerServicer):
    """The real servicer; counts the `DetokenizeSequences` messages it reads and holds back
    one that carries `HELD_TOKEN_ID`."""

    num_messages = 0

    async def DetokenizeSequences(
            self, request_iterator: AsyncIterator[pb.DetokenizeSequencesRequest],
            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DetokenizeSequencesResponse]:
        async def observed() -> AsyncIterator[pb.DetokenizeSequencesRequest]:
            async for request in request_iterator:
                self.num_messages += 1
                if any(HELD_TOKEN_ID in step.token_ids for step in request.steps):
                    await asyncio.sleep(HOLD_S)
                yield request

        async for reply in super().DetokenizeSequences(observed(), context):
            yield reply


@pytest.fixture(scope="module")
def core(embedded_model_path: Path) -> TokenizerCore:
    return TokenizerCore(str(embedded_model_path))


async def start_server(servicer: TokenizerServicer, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def run_against_service(core: TokenizerCore,
                        scenario: Callable[[TokenizerClient, ObservedServicer], Awaitable[None]],
                        *, timeout_s: float | None = 10.0) -> None:
    async def run() -> None:
        servicer = ObservedServicer(core)
        port = free_port()
        server = await start_server(servicer, port)
        client = TokenizerClient(f"127.0.0.1:{port}", timeout_s=timeout_s)
        try:
            await scenario(client, servicer)
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(run())


def test_concurrent_sequences_share_messages_and_each_gets_its_own_text(core: TokenizerCore) -> None:
    prompt = core.encode(PROMPT, add_special_tokens=False)
    completions = [core.encode(text, add_special_tokens=False) for text in COMPLETIONS * 6]

    async def scenario(client: TokenizerClient, servicer: ObservedServicer) -> None:
        async def stream(token_ids: list[int]) -> str:
            detokenizer = client.detokenizer(skip_special_tokens=True, prompt_token_ids=prompt)
            deltas = [await detokenizer.step([token_id]) for token_id in token_ids]
            detokenizer.close()
            return "".join(deltas)

        texts = await asyncio.gather(*(stream(ids) for ids in completions))
        assert texts == COMPLETIONS * 6
        num_steps = sum(len(ids) for ids in completions)
        # 24 sequences stepping together: about one message a round (15 for 294 steps), not
        # one a step.
        assert servicer.num_messages <= 2 * max(len(ids) for ids in completions), (
            servicer.num_messages, num_steps)

    run_against_service(core, scenario)


def test_a_token_past_the_vocabulary_fails_its_sequence_alone(core: TokenizerCore) -> None:
    async def scenario(client: TokenizerClient, servicer: ObservedServicer) -> None:
        good = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
        bad = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
        hello, world = core.encode("Hello world", add_special_tokens=False)
        results = await asyncio.gather(good.step([hello]), bad.step([2**32 - 1]),
                                       return_exceptions=True)
        assert results[0] == "Hello"
        assert isinstance(results[1], grpc.aio.AioRpcError)
        assert results[1].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert results[1].details().startswith(f"token_ids: token id {2**32 - 1} lies outside")
        assert await good.step([world]) == " world"
        # The service closed the failed sequence.
        with pytest.raises(grpc.aio.AioRpcError, match="is not open"):
            await bad.step([hello])

    run_against_service(core, scenario)


class FailingTokenCore:
    """Stand-in for the tokenizers library failing on one token (none fails on demand): the
    real core, whose detokenizers raise on `FAILING_TOKEN_ID`."""

    def __init__(self, core: TokenizerCore) -> None:
        self._core = core

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def detokenizer(self, *, skip_special_tokens: bool) -> Any:
        real = self._core.detokenizer(skip_special_tokens=skip_special_tokens)

        class Failing:
            def step(self, token_ids: list[int]) -> str:
                if FAILING_TOKEN_ID in token_ids:
                    raise RuntimeError("stand-in failure")
                return real.step(token_ids)

        return Failing()


FAILING_TOKEN_ID = 1000


def test_the_tokenizer_failing_on_one_sequence_leaves_the_stream_to_the_others_with_a_stand_in(
        core: TokenizerCore) -> None:
    hello, world = core.encode("Hello world", add_special_tokens=False)

    async def run() -> None:
        port = free_port()
        server = await start_server(TokenizerServicer(FailingTokenCore(core)), port)  # type: ignore[arg-type]
        client = TokenizerClient(f"127.0.0.1:{port}", timeout_s=10.0)
        try:
            good = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
            bad = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
            assert await good.step([hello]) == "Hello"
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await bad.step([FAILING_TOKEN_ID])
            assert failure.value.code() == grpc.StatusCode.INTERNAL
            assert failure.value.details() == "detokenizing failed: RuntimeError('stand-in failure')"
            assert await good.step([world]) == " world"
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(run())


def test_a_closed_sequence_is_dropped_by_the_service(core: TokenizerCore) -> None:
    async def scenario(client: TokenizerClient, servicer: ObservedServicer) -> None:
        call = client.stub.DetokenizeSequences()
        await call.write(pb.DetokenizeSequencesRequest(steps=[
            pb.SequenceStep(sequence_id=7, open=True, token_ids=core.encode("Hi", add_special_tokens=False))]))
        assert [t.text for t in (await call.read()).texts] == ["Hi"]
        await call.write(pb.DetokenizeSequencesRequest(closed_sequence_ids=[7]))
        assert list((await call.read()).texts) == []
        await call.write(pb.DetokenizeSequencesRequest(steps=[pb.SequenceStep(sequence_id=7, token_ids=[504])]))
        [text] = (await call.read()).texts
        assert text.error == "sequence 7 is not open"
        call.cancel()

    run_against_service(core, scenario)


def test_a_step_past_its_deadline_leaves_the_others_their_own_replies(core: TokenizerCore) -> None:
    """The late reply of a step given up on is matched to that step, not read as the next."""
    hello, world = core.encode("Hello world", add_special_tokens=False)

    async def scenario(client: TokenizerClient, servicer: ObservedServicer) -> None:
        held = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
        other = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
        assert await other.step([hello]) == "Hello"
        with pytest.raises(TokenizerTimeoutError):
            await held.step([HELD_TOKEN_ID])
        # Sent behind the held message, answered after it.
        assert await other.step([world]) == " world"

    run_against_service(core, scenario, timeout_s=HOLD_S * 2 / 3)


def test_a_sequence_on_a_lost_stream_goes_on_on_the_clients_next_one(core: TokenizerCore) -> None:
    """A restarted service has none of the old stream's sequences: one opens again on the new
    stream, brought up to date with the tokens it stepped, and goes on; a new sequence shares
    that stream."""
    hello, world = core.encode("Hello world", add_special_tokens=False)

    async def run() -> None:
        port = free_port()
        server = await start_server(ObservedServicer(core), port)
        client = TokenizerClient(f"127.0.0.1:{port}", timeout_s=10.0)
        try:
            before = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
            assert await before.step([hello]) == "Hello"
            await server.stop(None)
            server = await start_server(ObservedServicer(core), port)
            assert await asyncio.wait_for(before.step([world]), 10) == " world"
            assert await first_step_once_reconnected(client, [hello, world]) == "Hello world"
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(run())


def test_a_step_is_not_tried_again_once_its_client_closed(core: TokenizerCore) -> None:
    async def run() -> None:
        port = free_port()
        server = await start_server(ObservedServicer(core), port)
        client = TokenizerClient(f"127.0.0.1:{port}", timeout_s=10.0)
        try:
            sequence = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
            assert await sequence.step([504]) != ""
            await client.close()
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await asyncio.wait_for(sequence.step([504]), 10)
            assert failure.value.details() == "the tokenizer client closed"
        finally:
            await server.stop(None)

    asyncio.run(run())


async def first_step_once_reconnected(client: TokenizerClient, token_ids: list[int]) -> str:
    """A new sequence's first step, tried until the channel has reconnected."""
    for _ in range(50):
        try:
            return await client.detokenizer(skip_special_tokens=True,
                                            prompt_token_ids=[]).step(token_ids)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            await asyncio.sleep(0.2)
    raise AssertionError("the client never reconnected")


class ShortAnsweringServicer(TokenizerServicer):
    """Answers each message one text short, as a broken service might."""

    async def DetokenizeSequences(
            self, request_iterator: AsyncIterator[pb.DetokenizeSequencesRequest],
            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DetokenizeSequencesResponse]:
        async for reply in super().DetokenizeSequences(request_iterator, context):
            yield pb.DetokenizeSequencesResponse(texts=reply.texts[:-1])


def test_a_reply_that_does_not_match_its_message_fails_the_stream_not_hangs_it(
        core: TokenizerCore) -> None:
    async def run() -> grpc.aio.AioRpcError:
        port = free_port()
        server = await start_server(ShortAnsweringServicer(core), port)
        # No deadline: a step left unanswered would wait forever.
        client = TokenizerClient(f"127.0.0.1:{port}", timeout_s=None)
        try:
            detokenizer = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await asyncio.wait_for(detokenizer.step([504]), 10)
            return failure.value
        finally:
            await client.close()
            await server.stop(None)

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "the tokenizer service answered 1 of 2 steps"
