"""gRPC transport for `TokenizerCore`."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc

from backport.v1 import tokenizer_pb2 as pb
from backport.v1 import tokenizer_pb2_grpc
from services.tokenizer.chat_formats import ChatRenderError
from services.tokenizer.core import (LONG_DECODE_NUM_TOKENS, StreamingDetokenizer, TokenizerCore,
                                     UnknownTokenIdError)

T = TypeVar("T")

logger = logging.getLogger(__name__)


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, core: TokenizerCore) -> None:
        self.core = core

    async def RenderChat(self, request: pb.RenderChatRequest,
                         context: grpc.aio.ServicerContext) -> pb.RenderChatResponse:
        try:
            messages = _json_field("messages", request.messages_json, [], list)
            tools = _json_field("tools", request.tools_json, None, list) or None
            template_kwargs = _json_field("chat_template_kwargs", request.template_kwargs_json,
                                          {}, dict)
            # Rendering and tokenizing a long prompt must not stall other streams.
            prompt, token_ids = await asyncio.to_thread(
                self.core.render_chat, messages, tools, template_kwargs,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                add_special_tokens=request.add_special_tokens)
        except ChatRenderError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return pb.RenderChatResponse(token_ids=token_ids, prompt=prompt)

    async def Encode(self, request: pb.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        token_ids = await asyncio.to_thread(self.core.encode, request.text,
                                            add_special_tokens=request.add_special_tokens)
        return pb.EncodeResponse(token_ids=token_ids)

    async def Decode(self, request: pb.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> pb.DecodeResponse:
        token_ids = list(request.token_ids)
        await self._check_token_ids(context, "token_ids", token_ids)
        text = await _decode(len(token_ids), self.core.decode, token_ids,
                             skip_special_tokens=request.skip_special_tokens)
        return pb.DecodeResponse(text=text)

    async def DecodeTokens(self, request: pb.DecodeTokensRequest,
                           context: grpc.aio.ServicerContext) -> pb.DecodeTokensResponse:
        token_ids = list(request.token_ids)
        await self._check_token_ids(context, "token_ids", token_ids)
        texts = await _decode(len(token_ids), self.core.decode_each, token_ids)
        return pb.DecodeTokensResponse(texts=texts, utf8=[t.encode() for t in texts])

    async def DecodeTokensInContext(self, request: pb.DecodeTokensInContextRequest,
                                    context: grpc.aio.ServicerContext) -> pb.DecodeTokensResponse:
        for index, token in enumerate(request.tokens):
            await self._check_token_ids(context, f"tokens[{index}].token_id", [token.token_id])
            await self._check_token_ids(context, f"tokens[{index}].context_token_ids",
                                        token.context_token_ids)
        texts = await _decode(len(request.tokens), self._decode_in_context, list(request.tokens))
        return pb.DecodeTokensResponse(texts=texts, utf8=[t.encode() for t in texts])

    def _decode_in_context(self, tokens: list[pb.TokenInContext]) -> list[str]:
        return [self.core.decode_in_context(t.token_id, list(t.context_token_ids)) for t in tokens]

    async def Detokenize(self, request_iterator: AsyncIterator[pb.DetokenizeRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DetokenizeResponse]:
        detokenizer = None
        async for request in request_iterator:
            if detokenizer is None:
                detokenizer = self.core.detokenizer(skip_special_tokens=request.skip_special_tokens)
            token_ids = list(request.token_ids)
            await self._check_token_ids(context, "token_ids", token_ids)
            yield pb.DetokenizeResponse(text=detokenizer.step(token_ids))

    async def DetokenizeSequences(
            self, request_iterator: AsyncIterator[pb.DetokenizeSequencesRequest],
            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DetokenizeSequencesResponse]:
        # The stream's own: they go with it, whatever the client closed.
        sequences: dict[int, StreamingDetokenizer] = {}
        async for request in request_iterator:
            texts = [self._sequence_step(sequences, step) for step in request.steps]
            for sequence_id in request.closed_sequence_ids:
                sequences.pop(sequence_id, None)
            yield pb.DetokenizeSequencesResponse(texts=texts)

    def _sequence_step(self, sequences: dict[int, StreamingDetokenizer],
                       step: pb.SequenceStep) -> pb.SequenceText:
        if step.open:
            sequences[step.sequence_id] = self.core.detokenizer(
                skip_special_tokens=step.skip_special_tokens)
        detokenizer = sequences.get(step.sequence_id)
        if detokenizer is None:
            return _step_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"sequence {step.sequence_id} is not open")
        token_ids = list(step.token_ids)
        try:
            self.core.check_token_ids("token_ids", token_ids)
            return pb.SequenceText(text=detokenizer.step(token_ids))
        except UnknownTokenIdError as error:
            del sequences[step.sequence_id]
            return _step_error(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Exception as error:
            # One sequence's failure must not end the stream every other sequence is on.
            logger.exception("detokenizing sequence %d failed", step.sequence_id)
            del sequences[step.sequence_id]
            return _step_error(grpc.StatusCode.INTERNAL, f"detokenizing failed: {error!r}")

    async def _check_token_ids(self, context: grpc.aio.ServicerContext, field: str,
                               token_ids: Sequence[int]) -> None:
        try:
            self.core.check_token_ids(field, token_ids)
        except UnknownTokenIdError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    async def GetTokenizerInfo(self, request: pb.GetTokenizerInfoRequest,
                               context: grpc.aio.ServicerContext) -> pb.TokenizerInfo:
        info = pb.TokenizerInfo(tokenizer=self.core.model_path, vocab_size=self.core.vocab_size,
                                eos_token_ids=self.core.eos_token_ids,
                                chat_format=self.core.renderer.name)
        if self.core.hf.bos_token_id is not None:
            info.bos_token_id = self.core.hf.bos_token_id
        return info


def _step_error(code: grpc.StatusCode, message: str) -> pb.SequenceText:
    return pb.SequenceText(error=message, error_code=code.value[0])


async def _decode(num_tokens: int, decode: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Decodes a long list on a worker thread: on the event loop it would hold every other
    call and stream (100k tokens take 75 ms one by one); a short one costs less than the hop."""
    if num_tokens <= LONG_DECODE_NUM_TOKENS:
        return decode(*args, **kwargs)
    return await asyncio.to_thread(decode, *args, **kwargs)


def _json_field(field: str, text: str, default: Any, kind: type) -> Any:
    """A request's JSON text field as Python values, `default` when empty; raises
    `ChatRenderError` naming `field` (or the place inside it) for what a template cannot take."""
    if not text:
        return default
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ChatRenderError(field, f"is not JSON: {error}") from None
    except RecursionError:
        raise ChatRenderError(field, "is nested too deeply") from None
    if not isinstance(value, kind):
        raise ChatRenderError(field, f"must be a JSON {'array' if kind is list else 'object'}")
    if kind is list:
        for index, item in enumerate(value):
            if not isinstance(item, dict):
                raise ChatRenderError(f"{field}[{index}]", "must be a JSON object")
    _check_numbers(field, value)
    return value


def _check_numbers(path: str, value: Any) -> None:
    """Python's JSON reads NaN and Infinity, which JSON has no way to write."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ChatRenderError(path, f"{value} is not a JSON number")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_numbers(f"{path}.{key}", item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_numbers(f"{path}[{index}]", item)
