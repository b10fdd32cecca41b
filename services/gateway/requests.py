"""Turning a validated OpenAI request into an engine request: prompt checks and sampling."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request

from backport.v1 import engine_pb2 as pb
from services.gateway.backend import GatewayBackend, ServedModel
from services.gateway.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError
from services.gateway.parsing.forced_tool_calls import ForcedToolChoice
from services.gateway.schemas import MIN_POSITIVE_FLOAT32, SamplingFields


def backend_of(request: Request) -> GatewayBackend:
    return request.app.state.backend


def check_model(backend: GatewayBackend, name: str) -> ServedModel:
    model = backend.served_model()
    if name != model.name:
        raise ModelNotFoundError(f"The model `{name}` does not exist; this server serves "
                                 f"`{model.name}`.", param="model")
    return model


def check_context(model: ServedModel, num_prompt_tokens: int, token_limit: int | None,
                  *, min_tokens: int, prompt_param: str, limit_param: str) -> None:
    if num_prompt_tokens >= model.max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {model.max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens.", param=prompt_param)
    # A limit past the room the prompt leaves is cut to it in the engine.
    if token_limit is not None and token_limit > model.max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {model.max_model_len} tokens, but "
            f"{limit_param}={token_limit} asks for more.", param=limit_param)
    # A floor is not cut: the engine would refuse it past the cut limit, naming no field.
    room = model.max_model_len - num_prompt_tokens
    if min_tokens > room:
        raise ContextLengthError(
            f"This model's maximum context length is {model.max_model_len} tokens, and the prompt "
            f"has {num_prompt_tokens}, leaving room for {room}, but min_tokens={min_tokens}.",
            param="min_tokens")


def truncated_prompt(model: ServedModel, body: SamplingFields, prompt_ids: list[int]) -> list[int]:
    """The prompt cut to vLLM's `truncate_prompt_tokens`: its last tokens, or its first with
    `truncation_side: "right"`."""
    num_kept = body.truncate_prompt_tokens
    if num_kept is None:
        return prompt_ids
    if num_kept > model.max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens={num_kept} cannot be greater than the model's maximum "
            f"context length of {model.max_model_len} tokens", param="truncate_prompt_tokens")
    if num_kept == 0:
        raise InvalidRequestError("truncate_prompt_tokens=0 leaves no prompt",
                                  param="truncate_prompt_tokens")
    if num_kept == -1:
        # As vLLM: the whole context, less a token for the output when a limit is asked for.
        num_kept = model.max_model_len - 1 if body.token_limit else model.max_model_len
    if num_kept >= len(prompt_ids):
        return prompt_ids
    if body.truncation_side == "right":
        return prompt_ids[:num_kept]
    return prompt_ids[len(prompt_ids) - num_kept:]


def check_token_ids(model: ServedModel, body: SamplingFields,
                    prompts: list[list[int]] | None = None) -> None:
    """Token ids the client wrote itself must lie in the model's vocabulary."""
    check_in_vocabulary(model, "stop_token_ids", body.stop_token_ids)
    check_in_vocabulary(model, "logit_bias", [int(token) for token in body.logit_bias or {}])
    check_in_vocabulary(model, "allowed_token_ids", body.allowed_token_ids or [])
    check_in_vocabulary(model, "prompt", [i for prompt in prompts or [] for i in prompt])


def check_in_vocabulary(model: ServedModel, param: str, token_ids: list[int]) -> None:
    outside = sorted({i for i in token_ids if i >= model.vocab_size})
    if outside:
        raise InvalidRequestError(f"{param}: token ids {outside[:8]} lie outside the vocabulary "
                                  f"of {model.vocab_size} tokens", param=param)


@dataclass(frozen=True, slots=True)
class RequestedConstraint:
    """The structured output a request asks for, and the field its errors name."""

    param: str
    engine_form: pb.StructuredOutput


def output_constraint(body: SamplingFields, forced_tools: ForcedToolChoice | None = None, *,
                      after_reasoning: bool = False) -> RequestedConstraint | None:
    """From `response_format`, vLLM's `structured_outputs` or a forced `tool_choice`: one at most.
    `after_reasoning`: the output starts inside the model's reasoning, which the constraint
    leaves free (as vLLM does with a reasoning parser)."""
    asked = [name for name, given in (("response_format", body.response_format is not None
                                       and body.response_format.type != "text"),
                                      ("structured_outputs", body.structured_outputs is not None),
                                      ("tool_choice", forced_tools is not None)) if given]
    if len(asked) > 1:
        raise InvalidRequestError(f"{asked[1]}: cannot be combined with {asked[0]}", param=asked[1])
    if not asked:
        return None
    if forced_tools is not None:
        form = pb.StructuredOutput(json_schema=json.dumps(forced_tools.json_schema()))
    elif body.structured_outputs is not None:
        wanted = body.structured_outputs
        if wanted.json_ is not None:
            schema = wanted.json_ if isinstance(wanted.json_, str) else json.dumps(wanted.json_)
            form = pb.StructuredOutput(json_schema=schema)
        elif wanted.choice is not None:
            form = pb.StructuredOutput(choice=pb.Choices(choices=wanted.choice))
        else:
            form = pb.StructuredOutput(json_object=wanted.json_object, regex=wanted.regex,
                                       grammar=wanted.grammar)
    elif body.response_format.json_schema is None:
        form = pb.StructuredOutput(json_object=True)
    else:
        form = pb.StructuredOutput(json_schema=json.dumps(body.response_format.json_schema.schema_))
    form.after_reasoning = after_reasoning
    # A forced call's schema is made of the tools' parameters: what the engine cannot compile
    # is in `tools`.
    return RequestedConstraint("tools" if forced_tools is not None else asked[0], form)


# vLLM's header: a router may set a request's priority without rewriting its body.
PRIORITY_HEADER = "X-Vllm-Priority"


def request_priority(body: SamplingFields, request: Request) -> int:
    """The body's `priority`, or the header's where it is sent, as in vLLM. vLLM ignores a
    header that is not a whole number; here it is a 400, as a bad body field is."""
    header = request.headers.get(PRIORITY_HEADER)
    if header is None:
        return body.priority
    try:
        priority = int(header)
    except ValueError:
        priority = None
    if priority is None or not -(2**63) <= priority < 2**63:
        raise InvalidRequestError(f"the {PRIORITY_HEADER} header must be a 64-bit whole number, "
                                  f"not {header!r}", param=PRIORITY_HEADER)
    return priority


def generate_request(body: SamplingFields, prompt_token_ids: list[int], *, request_id: str,
                     priority: int, token_limit: int | None, num_logprobs: int | None,
                     constraint: RequestedConstraint | None = None) -> pb.GenerateRequest:
    """`request_id` is the id the client sees (as vLLM's server does), so an operator's logs
    and the engine's `Abort` take the id a client reports."""
    sampling = pb.SamplingParams(
        n=body.n, min_tokens=body.min_tokens, stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()},
        allowed_token_ids=body.allowed_token_ids or [], bad_words=body.bad_words)
    for name in ("temperature", "top_k", "min_p", "seed", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(sampling, name, value)
    if body.top_p is not None:
        # OpenAI's top_p 0 keeps the likeliest token alone; vLLM's range leaves 0 out, and its
        # least positive value does the same.
        sampling.top_p = max(body.top_p, MIN_POSITIVE_FLOAT32)
    if token_limit is not None:
        sampling.max_tokens = token_limit
    if num_logprobs is not None:
        sampling.logprobs = num_logprobs
    if body.num_prompt_logprobs is not None:
        sampling.prompt_logprobs = body.num_prompt_logprobs
    if body.thinking_token_budget not in (None, -1):
        sampling.thinking_token_budget = body.thinking_token_budget
    if constraint is not None:
        sampling.structured_output.CopyFrom(constraint.engine_form)
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                              sampling=sampling, cache_salt=body.cache_salt or "",
                              priority=priority)
