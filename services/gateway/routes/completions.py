"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway.backend import GatewayBackend, ServedModel
from services.gateway.errors import InvalidRequestError
from services.gateway.generation import (Generation, PromptTokenLogprobs, TokenLogprob, UsageCounts,
                                         finite_logprob, prompt_logprobs_json, shown_token)
from services.gateway.requests import (backend_of, check_context, check_model, check_token_ids,
                                       generate_request, output_constraint, request_priority,
                                       truncated_prompt)
from services.gateway.schemas import CompletionRequest, new_id, now
from services.gateway.sse import EventStreamResponse, sse_event, sse_stream, usage_dict

router = APIRouter(prefix="/v1", tags=["completions"])


@router.post("/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> JSONResponse | EventStreamResponse:
    backend = backend_of(request)
    model = check_model(backend, body.model)
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    prompts = await _prompt_token_ids(backend, body.prompt, body.add_special_tokens)
    check_token_ids(model, body, prompts)
    constraint = output_constraint(body)
    priority = request_priority(body, request)
    completion_id = new_id("cmpl")
    generations = []
    for index, whole_prompt_ids in enumerate(prompts):
        prompt_ids = truncated_prompt(model, body, whole_prompt_ids)
        check_context(model, len(prompt_ids), body.token_limit, min_tokens=body.min_tokens,
                      prompt_param="prompt", limit_param="max_tokens")
        generations.append(Generation(
            backend.pick_engine(user=body.user), backend.tokenizer,
            # One engine request a prompt, numbered as vLLM's server numbers them.
            generate_request(body, prompt_ids, request_id=f"{completion_id}-{index}",
                             priority=priority, token_limit=body.token_limit, num_logprobs=body.num_logprobs,
                             constraint=constraint),
            stop_strings=body.stop_strings, skip_special_tokens=body.skip_special_tokens,
            include_stop_str=body.include_stop_str_in_output,
            constraint_param=constraint.param if constraint is not None else None))
    # As vLLM: a truncated prompt is echoed whole.
    echoes = await _echoes(backend, body.prompt, prompts) if body.echo else None
    try:
        for generation in generations:
            await generation.start()
    except BaseException:
        for generation in generations:
            generation.cancel()
        raise
    completion = _Completion(completion_id, model, body.n, generations, echoes, body.logprobs,
                             is_echo_only=body.is_echo_only,
                             shows_token_ids=body.return_tokens_as_token_ids)
    if body.stream:
        return EventStreamResponse(sse_stream(completion.chunks(body.include_usage,
                                                                body.include_continuous_usage)))
    return JSONResponse(await completion.response())


async def _echoes(backend: GatewayBackend, prompt: str | list[str] | list[int] | list[list[int]],
                  prompt_token_ids: list[list[int]]) -> list[str]:
    """Text prompts as the client wrote them, as vLLM echoes them (decoded, they would carry
    the special tokens encoding put in, such as a BOS); token prompts decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]  # a list of strings, checked
    return [await backend.tokenizer.decode(p, skip_special_tokens=False) for p in prompt_token_ids]


async def _prompt_token_ids(backend: GatewayBackend,
                            prompt: str | list[str] | list[int] | list[list[int]],
                            add_special_tokens: bool) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await backend.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [await backend.tokenizer.encode(p, add_special_tokens=add_special_tokens)
            if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[union-attr]


class _Completion:
    """Shapes the deltas of one generation per prompt as text_completion objects.

    Choice `i` of prompt `p` is index `p * n + i`, as in OpenAI's batched completions.
    `is_echo_only` (`echo` with `max_tokens: 0`) leaves the generated token out of the choices;
    the usage counts it, as vLLM's does. `shows_token_ids` (vLLM's `return_tokens_as_token_ids`)
    writes logprob tokens as "token_id:<id>".
    """

    def __init__(self, completion_id: str, model: ServedModel, n: int, generations: list[Generation],
                 echoes: list[str] | None, num_logprobs: int | None, *, is_echo_only: bool,
                 shows_token_ids: bool) -> None:
        self.id = completion_id
        self.created = now()
        self.model = model
        self.n = n
        self.generations = generations
        self.echoes = echoes
        self.num_logprobs = num_logprobs
        self.is_echo_only = is_echo_only
        self.shows_token_ids = shows_token_ids

    def _echoed_logprobs(self, generation: Generation) -> list[_LogprobEntry]:
        """With `echo`, the prompt's tokens lead a choice's logprobs (OpenAI's legacy rule)."""
        if self.echoes is None or self.num_logprobs is None or generation.prompt_logprobs is None:
            return []
        return _prompt_entries(generation.prompt_logprobs, self.num_logprobs, self.shows_token_ids)

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
                    text = "" if self.is_echo_only else delta.text
                    entries = ([] if self.is_echo_only
                               else _generated_entries(delta.logprobs, self.shows_token_ids))
                    if delta.index not in positions:
                        positions[delta.index] = 0
                        text = echo + text
                        entries = self._echoed_logprobs(generation) + entries
                    logprobs = None
                    if entries:
                        logprobs = _logprobs(entries, positions[delta.index])
                        positions[delta.index] += sum(len(token) for token, _, _ in entries)
                    chunk = self._object([{"index": p * self.n + delta.index, "text": text,
                                           "logprobs": logprobs, "finish_reason": delta.finish_reason,
                                           "stop_reason": delta.stop_reason}])
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
                collected = await generation.collect()
                echoed = self._echoed_logprobs(generation)
                for i, choice in enumerate(collected):
                    generated_text, generated_logprobs = choice.text, choice.logprobs
                    if self.is_echo_only:
                        generated_text, generated_logprobs = "", []
                    logprobs = None
                    if self.num_logprobs is not None:
                        logprobs = _logprobs(echoed + _generated_entries(generated_logprobs,
                                                                         self.shows_token_ids), 0)
                    shaped = {"index": p * self.n + i, "text": echo + generated_text,
                              "logprobs": logprobs, "finish_reason": choice.finish_reason,
                              "stop_reason": choice.stop_reason}
                    if generation.prompt_logprobs is not None:
                        shaped["prompt_logprobs"] = prompt_logprobs_json(generation.prompt_logprobs)
                    choices.append(shaped)
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


# A token's text, logprob and top logprobs by text; the logprobs None for the prompt's first token.
_LogprobEntry = tuple[str, float | None, dict[str, float] | None]


def _generated_entries(entries: list[TokenLogprob], shows_token_ids: bool) -> list[_LogprobEntry]:
    # As vLLM: the sampled token leads its top logprobs, so they hold it even when it ranks lower.
    return [(token := shown_token(e.token_id, e.token, as_token_id=shows_token_ids),
             finite_logprob(e.logprob),
             {token: finite_logprob(e.logprob)} | {
                 shown_token(t.token_id, t.token, as_token_id=shows_token_ids): finite_logprob(t.logprob)
                 for t in e.top})
            for e in entries]


def _prompt_entries(prompt: list[PromptTokenLogprobs], num_top: int,
                    shows_token_ids: bool) -> list[_LogprobEntry]:
    # The prompt's token leads its candidates; vLLM keeps the first `num_top + 1` of them.
    return [(shown_token(entry.token_id, entry.token, as_token_id=shows_token_ids), None, None)
            if entry.candidates is None else
            (shown_token(entry.token_id, entry.token, as_token_id=shows_token_ids),
             finite_logprob(entry.candidates[0].logprob),
             {shown_token(c.token_id, c.token, as_token_id=shows_token_ids): finite_logprob(c.logprob)
              for c in entry.candidates[:num_top + 1]})
            for entry in prompt]


def _logprobs(entries: list[_LogprobEntry], first_offset: int) -> dict[str, Any]:
    offsets, position = [], first_offset
    for token, _, _ in entries:
        offsets.append(position)
        position += len(token)
    return {"tokens": [token for token, _, _ in entries],
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [top for _, _, top in entries], "text_offset": offsets}
