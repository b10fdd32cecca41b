"""Turning a validated OpenAI request into an engine request: prompt checks and sampling."""

from __future__ import annotations

from fastapi import Request

from backport.v1 import engine_pb2 as pb
from services.gateway.backend import GatewayBackend, ServedModel
from services.gateway.errors import ContextLengthError, ModelNotFoundError
from services.gateway.schemas import SamplingFields, new_id


def backend_of(request: Request) -> GatewayBackend:
    return request.app.state.backend


def check_model(backend: GatewayBackend, name: str) -> ServedModel:
    model = backend.served_model()
    if name != model.name:
        raise ModelNotFoundError(f"The model `{name}` does not exist; this server serves "
                                 f"`{model.name}`.", param="model")
    return model


def check_context(model: ServedModel, num_prompt_tokens: int, token_limit: int | None,
                  *, prompt_param: str, limit_param: str) -> None:
    if num_prompt_tokens >= model.max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {model.max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens.", param=prompt_param)
    if token_limit is not None and num_prompt_tokens + token_limit > model.max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {model.max_model_len} tokens, but "
            f"{num_prompt_tokens} prompt tokens plus {limit_param}={token_limit} exceed it.",
            param=limit_param)


def generate_request(body: SamplingFields, prompt_token_ids: list[int], *, token_limit: int | None,
                     num_logprobs: int | None) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        n=body.n, min_tokens=body.min_tokens, stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()})
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(sampling, name, value)
    if token_limit is not None:
        sampling.max_tokens = token_limit
    if num_logprobs is not None:
        sampling.logprobs = num_logprobs
    return pb.GenerateRequest(request_id=new_id("req"), prompt_token_ids=prompt_token_ids,
                              sampling=sampling)
