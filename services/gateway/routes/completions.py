"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.gateway.backend import GatewayBackend, ServedModel
from services.gateway.errors import InvalidRequestError
from services.gateway.generation import Generation, TokenLogprob, UsageCounts
from services.gateway.requests import (backend_of, check_context, check_model, check_token_ids,
                                       generate_request, output_constraint)
from services.gateway.schemas import CompletionRequest, new_id, now
from services.gateway.sse import sse_event, sse_stream, usage_dict

router = APIRouter(prefix="/v1", tags=["completions"])


@router.post("/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    backend = backend_of(request)
    model = check_model(backend, body.model)
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    prompts = await _prompt_token_ids(backend, body.prompt)
    check_token_ids(model, body, prompts)
    constraint = output_constraint(body)
    generations = []
    for prompt_ids in prompts:
        check_context(model, len(prompt_ids), body.token_limit, prompt_param="prompt",
                      limit_param="max_tokens")
        generations.append(Generation(
            backend.pick_engine(user=body.user), backend.tokenizer,
            generate_request(body, prompt_ids, token_limit=body.token_limit,
                             num_logprobs=body.num_logprobs, constraint=constraint),
            stop_strings=body.stop_strings, skip_special_tokens=body.skip_special_tokens))
    echoes = ([await backend.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
              if body.echo else None)
    try:
        for generation in generations:
            await generation.start()
    except BaseException:
        for generation in generations:
            generation.cancel()
        raise
    completion = _Completion(model, body.n, generations, echoes)
    if body.stream:
        return StreamingResponse(sse_stream(completion.chunks(body.include_usage,
                                                              body.include_continuous_usage)),
                                 media_type="text/event-stream")
    return JSONResponse(await completion.response())


async def _prompt_token_ids(backend: GatewayBackend,
                            prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await backend.tokenizer.encode(prompt, add_special_tokens=True)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [await backend.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            for p in prompt]  # type: ignore[union-attr]


class _Completion:
    """Shapes the deltas of one generation per prompt as text_completion objects.

    Choice `i` of prompt `p` is index `p * n + i`, as in OpenAI's batched completions.
    """

    def __init__(self, model: ServedModel, n: int, generations: list[Generation],
                 echoes: list[str] | None) -> None:
        self.id = new_id("cmpl")
        self.created = now()
        self.model = model
        self.n = n
        self.generations = generations
        self.echoes = echoes

    def _usage(self) -> dict[str, Any]:
        total = UsageCounts(
            prompt_tokens=sum(g.usage.prompt_tokens for g in self.generations),
            cached_tokens=sum(g.usage.cached_tokens for g in self.generations),
            completion_tokens_by_choice={(p, i): c for p, g in enumerate(self.generations)
                                         for i, c in g.usage.completion_tokens_by_choice.items()})
        return usage_dict(total)

    async def chunks(self, include_usage: bool, continuous_usage: bool) -> AsyncGenerator[str, None]:
        try:
            for p, generation in enumerate(self.generations):
                echo = self.echoes[p] if self.echoes else ""
                # Each choice's next token offset in its text: vLLM carries it across chunks.
                positions: dict[int, int] = {}
                async for delta in generation.deltas():
                    text = delta.text
                    if delta.index not in positions:
                        positions[delta.index] = len(echo)
                        text = echo + text
                    logprobs = None
                    if delta.logprobs:
                        logprobs = _logprobs(delta.logprobs, positions[delta.index])
                        positions[delta.index] += sum(len(e.token) for e in delta.logprobs)
                    chunk = self._object([{"index": p * self.n + delta.index, "text": text,
                                           "logprobs": logprobs, "finish_reason": delta.finish_reason}])
                    if continuous_usage:
                        chunk["usage"] = self._usage()
                    yield sse_event(chunk)
            if include_usage:
                yield sse_event(self._object([]) | {"usage": self._usage()})
        finally:
            self._cancel_all()

    async def response(self) -> dict[str, Any]:
        choices = []
        try:
            for p, generation in enumerate(self.generations):
                echo = self.echoes[p] if self.echoes else ""
                choices += [{"index": p * self.n + i, "text": echo + choice.text,
                             "logprobs": _logprobs(choice.logprobs, len(echo)) if choice.logprobs else None,
                             "finish_reason": choice.finish_reason}
                            for i, choice in enumerate(await generation.collect())]
        finally:
            self._cancel_all()
        return self._object(choices) | {"usage": self._usage()}

    def _cancel_all(self) -> None:
        """A batch's later prompts run while the earlier are read: a client gone, or a prompt
        failed, must not leave them running in the engines."""
        for generation in self.generations:
            generation.cancel()

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model.name, "choices": choices}


def _logprobs(entries: list[TokenLogprob], first_offset: int) -> dict[str, Any]:
    offsets, position = [], first_offset
    for entry in entries:
        offsets.append(position)
        position += len(entry.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}
