"""gRPC transport for `TokenizerCore`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict

from backport.v1 import tokenizer_pb2 as pb
from backport.v1 import tokenizer_pb2_grpc
from services.tokenizer.chat_formats import ChatRenderError
from services.tokenizer.core import LONG_DECODE_NUM_TOKENS, TokenizerCore

T = TypeVar("T")


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, core: TokenizerCore) -> None:
        self.core = core

    async def RenderChat(self, request: pb.RenderChatRequest,
                         context: grpc.aio.ServicerContext) -> pb.RenderChatResponse:
        messages = [MessageToDict(m) for m in request.messages]
        tools = [MessageToDict(t) for t in request.tools] or None
        template_kwargs = MessageToDict(request.template_kwargs)
        try:
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
        text = await _decode(len(request.token_ids), self.core.decode, list(request.token_ids),
                             skip_special_tokens=request.skip_special_tokens)
        return pb.DecodeResponse(text=text)

    async def DecodeTokens(self, request: pb.DecodeTokensRequest,
                           context: grpc.aio.ServicerContext) -> pb.DecodeTokensResponse:
        texts = await _decode(len(request.token_ids), self.core.decode_each,
                              list(request.token_ids))
        return pb.DecodeTokensResponse(texts=texts, utf8=[t.encode() for t in texts])

    async def DecodeTokensInContext(self, request: pb.DecodeTokensInContextRequest,
                                    context: grpc.aio.ServicerContext) -> pb.DecodeTokensResponse:
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
            yield pb.DetokenizeResponse(text=detokenizer.step(list(request.token_ids)))

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
