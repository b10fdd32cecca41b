"""Typed async client of the tokenizer service; imports no torch, vllm or transformers."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct

from backport.v1 import tokenizer_pb2 as pb
from backport.v1 import tokenizer_pb2_grpc
from services.mesh.channels import open_channel

TOKEN_TEXT_CACHE_SIZE = 65_536


class TokenizerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = open_channel(address)
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)
        self._token_texts: dict[int, str] = {}

    async def info(self, timeout_s: float = 10.0) -> pb.TokenizerInfo:
        return await self.stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest(), timeout=timeout_s)

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template_kwargs: dict[str, Any], *, add_generation_prompt: bool,
                          continue_final_message: bool) -> pb.RenderChatResponse:
        request = pb.RenderChatRequest(
            messages=[_struct(m) for m in messages], tools=[_struct(t) for t in tools or []],
            template_kwargs=_struct(template_kwargs), add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message)
        return await self.stub.RenderChat(request)

    async def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        reply = await self.stub.Encode(pb.EncodeRequest(text=text, add_special_tokens=add_special_tokens))
        return list(reply.token_ids)

    async def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str:
        reply = await self.stub.Decode(pb.DecodeRequest(token_ids=token_ids,
                                                        skip_special_tokens=skip_special_tokens))
        return reply.text

    async def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded alone (for logprobs), cached since the vocabulary never changes."""
        missing = sorted({t for t in token_ids if t not in self._token_texts})
        if missing:
            reply = await self.stub.DecodeTokens(pb.DecodeTokensRequest(token_ids=missing))
            if len(self._token_texts) + len(missing) > TOKEN_TEXT_CACHE_SIZE:
                self._token_texts.clear()
            self._token_texts.update(zip(missing, reply.texts))
        return [self._token_texts[t] for t in token_ids]

    def detokenizer(self, *, skip_special_tokens: bool) -> StreamDetokenizer:
        return StreamDetokenizer(self.stub, skip_special_tokens=skip_special_tokens)

    async def close(self) -> None:
        await self.channel.close()


class StreamDetokenizer:
    """One sequence's incremental detokenization over a bidirectional stream."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub, *, skip_special_tokens: bool) -> None:
        self._stub = stub
        self._skip_special_tokens = skip_special_tokens
        self._call: grpc.aio.StreamStreamCall | None = None

    async def step(self, token_ids: list[int]) -> str:
        if self._call is None:
            self._call = self._stub.Detokenize()
            request = pb.DetokenizeRequest(skip_special_tokens=self._skip_special_tokens,
                                           token_ids=token_ids)
        else:
            request = pb.DetokenizeRequest(token_ids=token_ids)
        await self._call.write(request)
        reply = await self._call.read()
        if reply is grpc.aio.EOF:
            raise ConnectionError("the tokenizer service closed the detokenize stream")
        return reply.text

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


def _struct(value: dict[str, Any]) -> Struct:
    struct = Struct()
    struct.update(value)
    return struct
