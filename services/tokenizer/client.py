"""Typed async client of the tokenizer service; imports no torch, vllm or transformers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

from backport.v1 import tokenizer_pb2 as pb
from backport.v1 import tokenizer_pb2_grpc
from services.mesh.channels import open_channel
from services.tokenizer.detokenize_stream import DetokenizeStream, SequenceDetokenizer
from services.tokenizer.errors import TokenizerTimeoutError

TOKEN_TEXT_CACHE_SIZE = 65_536
# What a token decoded alone shows for the bytes of a character it holds only part of.
REPLACEMENT_CHARACTER = "\ufffd"
# Tokens enough to hold any UTF-8 character's bytes (four at most).
MAX_CHARACTER_TOKENS = 4


class TokenizerClient:
    """`timeout_s` bounds each call and each detokenize step's round trip (None: no deadline):
    a hung service must fail the requests that need it, not hold them."""

    def __init__(self, address: str, *, timeout_s: float | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = open_channel(address)
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)
        self._token_texts: dict[int, str] = {}
        self._detokenize_stream = DetokenizeStream(self.stub, timeout_s=timeout_s)

    async def info(self, timeout_s: float = 10.0) -> pb.TokenizerInfo:
        return await self.stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest(), timeout=timeout_s)

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template_kwargs: dict[str, Any], *, add_generation_prompt: bool,
                          continue_final_message: bool,
                          add_special_tokens: bool = False) -> pb.RenderChatResponse:
        request = pb.RenderChatRequest(
            messages_json=_json(messages), tools_json=_json(tools) if tools else "",
            template_kwargs_json=_json(template_kwargs) if template_kwargs else "",
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, add_special_tokens=add_special_tokens)
        return await self._call(self.stub.RenderChat, request)

    async def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        reply = await self._call(self.stub.Encode, pb.EncodeRequest(
            text=text, add_special_tokens=add_special_tokens))
        return list(reply.token_ids)

    async def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str:
        reply = await self._call(self.stub.Decode, pb.DecodeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens))
        return reply.text

    async def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded alone (for logprobs), cached since the vocabulary never changes."""
        # Taken before the call: the cache may be cleared while it runs, by this call or another.
        texts = {t: self._token_texts[t] for t in token_ids if t in self._token_texts}
        missing = sorted(set(token_ids) - texts.keys())
        if missing:
            reply = await self._call(self.stub.DecodeTokens, pb.DecodeTokensRequest(token_ids=missing))
            decoded = dict(zip(missing, reply.texts))
            texts |= decoded
            if len(self._token_texts) + len(missing) > TOKEN_TEXT_CACHE_SIZE:
                self._token_texts.clear()
            self._token_texts |= decoded
        return [texts[t] for t in token_ids]

    async def logprob_token_texts(self, positions: Sequence[tuple[Sequence[int], Sequence[int]]]
                                  ) -> list[list[str]]:
        """Per position (the sequence's tokens before it, oldest first; its candidate token
        ids), each candidate's text as vLLM shows logprob tokens: decoded alone, unless that
        ends in part of a character; then the characters it completes after the tokens before
        it, or "" while they are incomplete (as `DecodeTokensInContext` decodes)."""
        alone = await self.token_texts([i for _, candidates in positions for i in candidates])
        texts, split = [], []
        for context, candidates in positions:
            texts.append(alone[:len(candidates)])
            alone = alone[len(candidates):]
            split += [(texts[-1], k, pb.TokenInContext(token_id=token_id, context_token_ids=context))
                      for k, token_id in enumerate(candidates) if texts[-1][k].endswith(REPLACEMENT_CHARACTER)]
        if split:
            reply = await self._call(self.stub.DecodeTokensInContext, pb.DecodeTokensInContextRequest(
                tokens=[token for _, _, token in split]))
            for (position_texts, k, _), text in zip(split, reply.texts, strict=True):
                position_texts[k] = text
        return texts

    def detokenizer(self, *, skip_special_tokens: bool,
                    prompt_token_ids: Sequence[int]) -> SequenceDetokenizer:
        """A sequence's incremental detokenization; every sequence of this client shares one
        stream, and its `timeout_s` bounds each step's round trip."""
        return self._detokenize_stream.sequence(skip_special_tokens=skip_special_tokens,
                                                prompt_token_ids=prompt_token_ids)

    async def close(self) -> None:
        await self._detokenize_stream.close()
        await self.channel.close()

    async def _call(self, method: grpc.aio.UnaryUnaryMultiCallable, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TokenizerTimeoutError(self.timeout_s) from error
            raise


def _json(value: Any) -> str:
    # NaN and Infinity go out as JavaScript writes them: the service names where they are.
    return json.dumps(value, ensure_ascii=False)
