"""POST /tokenize and POST /detokenize: vLLM's extension endpoints, on the tokenizer service.

`/tokenize` takes a `prompt` (encoded as completions encode it) or chat `messages` (rendered as
the chat path renders them, reasoning effort included), so a client can count a request's
tokens before sending it. Unlike vLLM's, `token_strs` are each token decoded on its own (the
text a logprob names), not the vocabulary's raw pieces. Both need the API key, as `/v1` does.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import Discriminator, Field, Tag, ValidationError

from services.gateway.reasoning_effort import RequestedEffort
from services.gateway.requests import backend_of, check_in_vocabulary, check_model
from services.gateway.routes.chat import render_chat_prompt
from services.gateway.schemas import ChatCompletionRequest, RequestBody, TokenId

router = APIRouter(tags=["tokenize"])


# A lone surrogate cannot reach the tokenizer service, nor be echoed in a 404's message: a
# `RequestBody` refuses it.
class _ModelField(RequestBody):
    # Optional, as in vLLM; when given it must name the served model.
    model: str | None = None


class _TokenizeFields(_ModelField):
    # vLLM's type: a client may send null for its default.
    return_token_strs: bool | None = False


class TokenizePromptRequest(_TokenizeFields):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: RequestedEffort | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's chat default: the template writes them
    # Refused by the chat path's check, as vLLM refuses it: counting with the model's template
    # instead would answer for another prompt than the one asked about.
    chat_template: str | None = None


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("Chat")] | Annotated[TokenizePromptRequest, Tag("Prompt")],
    Discriminator(lambda body: "Chat" if isinstance(body, dict) and "messages" in body else "Prompt")]


class DetokenizeRequest(_ModelField):
    tokens: list[TokenId]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    backend = backend_of(request)
    model = check_model(backend, body.model) if body.model else backend.served_model()
    if isinstance(body, TokenizeChatRequest):
        try:
            chat = ChatCompletionRequest.model_validate(body.model_dump(exclude_unset=True)
                                                        | {"model": model.name})
        except ValidationError as error:
            # The chat path's own checks on these fields; raised here, past FastAPI's validation,
            # they would reach the catch-all as a 500.
            raise RequestValidationError(error.errors()) from error
        token_ids, _ = await render_chat_prompt(backend, model, chat, request)
    else:
        token_ids = await backend.tokenizer.encode(body.prompt,
                                                   add_special_tokens=body.add_special_tokens)
    token_strs = await backend.tokenizer.token_texts(token_ids) if body.return_token_strs else None
    return {"count": len(token_ids), "max_model_len": model.max_model_len, "tokens": token_ids,
            "token_strs": token_strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    backend = backend_of(request)
    model = check_model(backend, body.model) if body.model else backend.served_model()
    check_in_vocabulary(model, "tokens", body.tokens)
    return {"prompt": await backend.tokenizer.decode(body.tokens, skip_special_tokens=False)}
