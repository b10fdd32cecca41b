"""gRPC transport for `TokenizerCore`."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.struct_pb2 import Struct, Value

from backport.v1 import tokenizer_pb2 as pb
from backport.v1 import tokenizer_pb2_grpc
from services.tokenizer.chat_formats import ChatRenderError
from services.tokenizer.core import LONG_DECODE_NUM_TOKENS, TokenizerCore, UnknownTokenIdError

T = TypeVar("T")


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, core: TokenizerCore) -> None:
        self.core = core

    async def RenderChat(self, request: pb.RenderChatRequest,
                         context: grpc.aio.ServicerContext) -> pb.RenderChatResponse:
        try:
            messages = [_from_struct(f"messages[{i}]", m) for i, m in enumerate(request.messages)]
            tools = [_from_struct(f"tools[{i}]", t) for i, t in enumerate(request.tools)] or None
            template_kwargs = _from_struct("chat_template_kwargs", request.template_kwargs)
            # Rendering and tokenizing a long prompt must not stall other streams.
            prompt, token_ids = await asyncio.to_thread(
                self.core.render_chat, messages, tools, template_kwargs,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message)
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


async def _decode(num_tokens: int, decode: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Decodes a long list on a worker thread: on the event loop it would hold every other
    call and stream (100k tokens take 75 ms one by one); a short one costs less than the hop."""
    if num_tokens <= LONG_DECODE_NUM_TOKENS:
        return decode(*args, **kwargs)
    return await asyncio.to_thread(decode, *args, **kwargs)


def _from_struct(path: str, struct: Struct) -> dict[str, Any]:
    """A request's JSON object as Python values; raises `ChatRenderError` naming `path`."""
    return {key: _from_value(f"{path}.{key}", value) for key, value in struct.fields.items()}


def _from_value(path: str, value: Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return _from_struct(path, value.struct_value)
    if kind == "list_value":
        return [_from_value(f"{path}[{i}]", item) for i, item in enumerate(value.list_value.values)]
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise ChatRenderError(path, f"{number} is not a JSON number")
        # A Struct carries every number as a double. JSON's integers reach vLLM's templates as
        # ints, and `tojson` of a schema's `"minimum": 1` must write 1, not 1.0; a client's 1.0
        # cannot be told from 1 here, and is the rarer of the two.
        return int(number) if number.is_integer() else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    return None  # null_value
