"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway.backend import GatewayBackend, ServedModel
from services.gateway.errors import InvalidRequestError
from services.gateway.generation import (ChoiceDelta, Generation, TokenLogprob, TopLogprob,
                                         finite_logprob, prompt_logprobs_json, shown_token)
from services.gateway.parsing import ChatOutputParser, MessageDelta
from services.gateway.parsing.formats import ReasoningFormat
from services.gateway.parsing.forced_tool_calls import ForcedToolCallParser, ForcedToolChoice
from services.gateway.parsing.registry import reasoning_format
from services.gateway.reasoning_effort import (EffortRequestError, passthrough_template_kwargs,
                                                requested_effort, resolve_session_effort, session_key)
from services.gateway.reasoning_tokens import ReasoningTokenCounter
from services.gateway.requests import (backend_of, check_context, check_model, check_token_ids,
                                       generate_request, output_constraint, request_priority,
                                       truncated_prompt)
from services.gateway.schemas import ChatCompletionRequest, new_id, now
from services.gateway.sse import EventStreamResponse, sse_event, sse_stream, usage_dict

router = APIRouter(prefix="/v1", tags=["chat"])


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest,
                                 request: Request) -> JSONResponse | EventStreamResponse:
    started = await start_chat_generation(body, request, request_id=new_id("chatcmpl"))
    completion = _ChatCompletion(started, body)
    if body.stream:
        return EventStreamResponse(sse_stream(completion.chunks(body.include_usage,
                                                                body.include_continuous_usage)))
    return JSONResponse(await completion.response())


@dataclass(frozen=True, slots=True)
class ChatGeneration:
    """A chat request's generation and the output parser of each of its choices."""

    request_id: str
    model_name: str
    generation: Generation
    parsers: list[ChatOutputParser | ForcedToolCallParser | None]


async def start_chat_generation(body: ChatCompletionRequest, request: Request, *,
                                request_id: str) -> ChatGeneration:
    """Renders, checks and starts a chat request; the Responses API is served through it too.
    `request_id` is the engine request's id, the one the client's response carries."""
    prepared = await prepare_chat_generation(body, request, request_id=request_id)
    await prepared.generation.start()
    return prepared


async def prepare_chat_generation(body: ChatCompletionRequest, request: Request, *,
                                  request_id: str) -> ChatGeneration:
    """Renders and checks a chat request; its generation starts on `start()` or when read."""
    backend = backend_of(request)
    model = check_model(backend, body.model)
    check_token_ids(model, body)
    prompt_ids, is_thinking = await render_chat_prompt(backend, model, body, request)
    prompt_ids = truncated_prompt(model, body, prompt_ids)
    check_context(model, len(prompt_ids), body.token_limit, min_tokens=body.min_tokens,
                  prompt_param="messages",
                  limit_param="max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    forced_tools = ForcedToolChoice.of(body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = output_constraint(body, forced_tools, after_reasoning=is_thinking)
    priority = request_priority(body, request)
    has_parser = bool(backend.settings.tool_call_parser or backend.settings.reasoning_parser)
    markers = model.reasoning_markers
    generation = Generation(
        backend.pick_engine(prompt_cache_key=body.prompt_cache_key, user=body.user),
        backend.tokenizer,
        generate_request(body, prompt_ids, request_id=request_id, priority=priority,
                         token_limit=body.token_limit, num_logprobs=body.num_logprobs,
                         constraint=constraint),
        stop_strings=body.stop_strings, include_stop_str=body.include_stop_str_in_output,
        # Parsers read markup that tokenizers often mark special.
        skip_special_tokens=body.skip_special_tokens and not has_parser,
        reasoning_counters=([ReasoningTokenCounter(markers, thinking=is_thinking)
                             for _ in range(body.n)] if markers else None),
        constraint_param=constraint.param if constraint is not None else None)
    parsers = [forced_tools.parser(backend.settings.reasoning_parser if is_thinking else None)
               if forced_tools else _output_parser(backend, body, is_thinking)
               for _ in range(body.n)]
    return ChatGeneration(request_id, model.name, generation, parsers)


async def render_chat_prompt(backend: GatewayBackend, model: ServedModel, body: ChatCompletionRequest,
                             request: Request) -> tuple[list[int], bool]:
    """The prompt's token ids as the chat request renders, and whether the output starts inside
    a reasoning block (always False without a reasoning parser)."""
    template_kwargs = await _template_kwargs(backend, model, body, request)
    try:
        rendered = await backend.tokenizer.render_chat(
            body.messages, body.tools, template_kwargs,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens)
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            details = error.details() or "invalid messages"
            raise InvalidRequestError(details, param=_render_error_param(details)) from error
        raise
    reasoning_parser = backend.settings.reasoning_parser
    is_thinking = bool(reasoning_parser) and output_starts_in_reasoning(
        rendered.prompt, reasoning_format(reasoning_parser),
        continues_final_message=body.continue_final_message)
    return list(rendered.token_ids), is_thinking


def output_starts_in_reasoning(prompt: str, reasoning: ReasoningFormat, *,
                               continues_final_message: bool) -> bool:
    """Whether the model writes its reasoning first, read from the rendered prompt.

    The request's flags cannot tell: GLM-5.3's template opens the block whatever
    `enable_thinking` says, and a Qwen3 template may leave the opening to the model. A
    generation prompt opens the block when it ends with the start marker; a continued message
    is inside the block when the last marker in the prompt opened one.
    """
    if continues_final_message:
        return prompt.rfind(reasoning.start) > prompt.rfind(reasoning.end)
    return prompt.rstrip().endswith(reasoning.start)


def _render_error_param(details: str) -> str:
    """The request field a render error names first (`tools[0]...`, `chat_template_kwargs.x`)."""
    for param in ("tools", "chat_template_kwargs"):
        if details.startswith(param):
            return param
    return "messages"


async def _template_kwargs(backend: GatewayBackend, model: ServedModel, body: ChatCompletionRequest,
                           request: Request) -> dict[str, Any]:
    """The template kwargs to render with: DeepSeek-V4's effort mapping, else the request's own."""
    try:
        if model.chat_format == "deepseek_v4":
            requested = requested_effort(reasoning_effort=body.reasoning_effort, thinking=body.thinking,
                                         chat_template_kwargs=body.chat_template_kwargs)
            key = session_key(session_id=request.headers.get("x-session-id"),
                              prompt_cache_key=body.prompt_cache_key, user=body.user)
            effort = await resolve_session_effort(requested, key, backend.effort_store)
            return effort.template_kwargs(body.chat_template_kwargs)
        return passthrough_template_kwargs(body.reasoning_effort, body.chat_template_kwargs)
    except EffortRequestError as error:
        raise InvalidRequestError(str(error), param=error.field) from error


def _output_parser(backend: GatewayBackend, body: ChatCompletionRequest,
                   is_thinking: bool) -> ChatOutputParser | None:
    settings = backend.settings
    if not (settings.tool_call_parser or settings.reasoning_parser):
        return None
    return ChatOutputParser(tool_call_parser=settings.tool_call_parser,
                            reasoning_parser=settings.reasoning_parser, tools=body.tools,
                            thinking=is_thinking,
                            allow_tool_calls=bool(body.tools) and body.tool_choice != "none",
                            allow_parallel_tool_calls=body.parallel_tool_calls is not False)


class _ChatCompletion:
    """Shapes one generation's deltas as chat.completion(.chunk) objects."""

    def __init__(self, started: ChatGeneration, body: ChatCompletionRequest) -> None:
        self.id = started.request_id
        self.created = now()
        self.model_name = started.model_name
        self.generation = started.generation
        self.parsers = started.parsers
        self.role = body.response_role
        self.echoed_content = body.echoed_content
        self.shows_token_ids = body.return_tokens_as_token_ids
        self.includes_reasoning = body.include_reasoning
        # OpenAI's rule, which vLLM follows: calls the model chose ("auto") or had to make
        # ("required") end with "tool_calls", the call the request named ends with "stop".
        self.names_its_tool_call = isinstance(body.tool_choice, Mapping)

    def _shows_tokens(self, index: int) -> bool:
        """Whether the choice's tokens may show in its logprobs: not where they would show the
        reasoning that `include_reasoning: false` leaves out (vLLM drops them wherever a parser
        reads the output)."""
        return self.includes_reasoning or self.parsers[index] is None

    def _finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        parser = self.parsers[index]
        if (finish_reason == "stop" and parser is not None and parser.has_tool_calls
                and not self.names_its_tool_call):
            return "tool_calls"
        return finish_reason

    async def chunks(self, include_usage: bool, continuous_usage: bool) -> AsyncGenerator[str, None]:
        try:
            for index in range(len(self.parsers)):
                opening = self._chunk([{"index": index, "delta": {"role": self.role, "content": ""},
                                        "logprobs": None, "finish_reason": None}])
                if continuous_usage:
                    opening["usage"] = usage_dict(self.generation.usage)
                yield sse_event(opening)
            if self.echoed_content:
                # As vLLM streams it: each choice's echo in a chunk of its own, before any output.
                for index in range(len(self.parsers)):
                    echo = self._chunk([{"index": index, "delta": {"content": self.echoed_content},
                                         "logprobs": None, "finish_reason": None}])
                    if continuous_usage:
                        echo["usage"] = usage_dict(self.generation.usage)
                    yield sse_event(echo)
            async with aclosing(self.generation.deltas()) as deltas:
                async for delta in deltas:
                    message = parse_choice_delta(self.parsers[delta.index], delta)
                    logprobs = delta.logprobs if self._shows_tokens(delta.index) else []
                    if not self.includes_reasoning:
                        message.reasoning_content = None
                    if message.is_empty and not logprobs and delta.finish_reason is None:
                        continue
                    finish_reason = self._finish_reason(delta.index, delta.finish_reason)
                    choices = [{"index": delta.index, "delta": message.to_dict(),
                                "logprobs": (chat_logprobs(logprobs, self.shows_token_ids)
                                             if logprobs else None),
                                "finish_reason": finish_reason, "stop_reason": delta.stop_reason}]
                    if finish_reason is not None and message.tool_calls:
                        # The finish in a chunk of its own, as OpenAI sends it: the SDK's stream
                        # helper ends a call (`arguments.done`) only on a chunk after its last.
                        choices = [choices[0] | {"finish_reason": None, "stop_reason": None},
                                   {"index": delta.index, "delta": {}, "logprobs": None,
                                    "finish_reason": finish_reason,
                                    "stop_reason": delta.stop_reason}]
                    for choice in choices:
                        chunk = self._chunk([choice])
                        if continuous_usage:
                            chunk["usage"] = usage_dict(self.generation.usage)
                        yield sse_event(chunk)
            if include_usage:
                yield sse_event(self._chunk([]) | {"usage": usage_dict(self.generation.usage)})
        finally:
            # A client gone before the deltas were read leaves the engine call started.
            self.generation.cancel()

    async def response(self) -> dict[str, Any]:
        choices = []
        collected = await self.generation.collect()
        for index, (parser, choice) in enumerate(zip(self.parsers, collected, strict=True)):
            if parser is None:
                message: dict[str, Any] = {"role": self.role, "content": choice.text}
            else:
                parser.feed(choice.text)
                parser.finish(model_stopped=choice.finish_reason == "stop")
                answer = parser.message()
                if not self.includes_reasoning:
                    answer.reasoning_content = None
                message = answer.to_dict() | {"role": self.role}
            if self.echoed_content:
                message["content"] = self.echoed_content + (message.get("content") or "")
            choices.append({"index": index, "message": message,
                            "finish_reason": self._finish_reason(index, choice.finish_reason),
                            "stop_reason": choice.stop_reason,
                            "logprobs": (chat_logprobs(choice.logprobs, self.shows_token_ids)
                                         if choice.logprobs and self._shows_tokens(index)
                                         else None)})
        response = {"id": self.id, "object": "chat.completion", "created": self.created,
                    "model": self.model_name, "choices": choices,
                    "usage": usage_dict(self.generation.usage)}
        if self.generation.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(self.generation.prompt_logprobs)
        return response

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model_name, "choices": choices}


def parse_choice_delta(parser: ChatOutputParser | ForcedToolCallParser | None,
                       delta: ChoiceDelta) -> MessageDelta:
    """What a choice's text delta adds to its message; its last delta flushes the parser."""
    if parser is None:
        return MessageDelta(content=delta.text or None)
    message = parser.feed(delta.text)
    if delta.finish_reason is not None:
        tail = parser.finish(model_stopped=delta.finish_reason == "stop")
        message = MessageDelta(
            reasoning_content=_join(message.reasoning_content, tail.reasoning_content),
            content=_join(message.content, tail.content),
            tool_calls=message.tool_calls + tail.tool_calls)
    return message


def _join(first: str | None, second: str | None) -> str | None:
    return None if first is None and second is None else (first or "") + (second or "")


def chat_logprobs(entries: list[TokenLogprob], shows_token_ids: bool) -> dict[str, Any]:
    """Each token and its top alternatives as vLLM's server lists them: the sampled token
    leads the alternatives, which are cut to the number asked for, so a token sampled below
    the top ones shows in place of the last of them. -inf has no JSON spelling: written as
    -9999.0, as vLLM writes it. With `return_tokens_as_token_ids` a token is written as
    "token_id:<id>"; vLLM keeps the sampled token's `bytes` its text's."""
    content = []
    for e in entries:
        listed = [TopLogprob(e.token_id, e.token, e.logprob),
                  *(t for t in e.top if t.token_id != e.token_id)][:len(e.top)]
        content.append({
            "token": shown_token(e.token_id, e.token, as_token_id=shows_token_ids),
            "logprob": finite_logprob(e.logprob),
            "bytes": list(e.token.encode()),
            "top_logprobs": [{"token": (token := shown_token(t.token_id, t.token,
                                                             as_token_id=shows_token_ids)),
                              "logprob": finite_logprob(t.logprob), "bytes": list(token.encode())}
                             for t in listed]})
    return {"content": content}
