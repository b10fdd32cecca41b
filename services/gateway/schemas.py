"""OpenAI request and response bodies, with vLLM's extra sampling fields."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from services.gateway.errors import RequestFieldError
from services.gateway.reasoning_effort import RequestedEffort

MAX_STOP_STRINGS = 16
# Token ids and counts travel as uint32, top_k as int32 and sampling numbers as 32-bit floats in
# the engine protocol; values out of their range are refused here, by name, rather than failing
# to serialise or arriving as infinity or 0.
MAX_UINT32 = 2**32 - 1
MAX_INT32 = 2**31 - 1
MAX_FLOAT32 = 3.4028234663852886e38
# The least positive 32-bit float: a smaller value the engine must see as positive arrives as 0.
MIN_POSITIVE_FLOAT32 = 2.0**-149
TokenId = Annotated[int, Field(ge=0, le=MAX_UINT32)]
# vLLM's limits on a cache salt, which keep it usable inside the KV service's cache keys.
MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")


def _checked_cache_salt(salt: str) -> str:
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS or _CACHE_SALT_FORBIDDEN_CHARS.intersection(salt):
        raise ValueError(f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                         "without '@', '/', '\\' or NUL")
    return salt


CacheSalt = Annotated[str, AfterValidator(_checked_cache_salt)]
# OpenAI's limits on the `metadata` of a response or a conversation.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def _checked_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise RequestFieldError("metadata", f"at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise RequestFieldError("metadata", f"keys hold at most {MAX_METADATA_KEY_CHARS} "
                                    f"characters and values {MAX_METADATA_VALUE_CHARS}; the "
                                    f"pair of key {key[:MAX_METADATA_KEY_CHARS]!r} is longer")
    return metadata


Metadata = Annotated[dict[str, str], AfterValidator(_checked_metadata)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    # Required, as by OpenAI and vLLM.
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: Literal[True] | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [name for name in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        return self


def _lone_surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string in `value` (or key) that is not valid Unicode, if any."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = _lone_surrogate_at(key, path) or _lone_surrogate_at(
                item, f"{path}.{key}" if path else str(key))
            if where is not None:
                return where
    elif isinstance(value, list):
        for index, item in enumerate(value):
            where = _lone_surrogate_at(item, f"{path}[{index}]")
            if where is not None:
                return where
    return None


def check_valid_unicode(body: Any) -> None:
    """Refuses a lone UTF-16 surrogate anywhere in a request body, naming its top field.

    JSON lets "\\ud800" through; such a string cannot be encoded for the tokenizer, the engine's
    protobuf or a JSON response echoing it, where it would fail as an internal error.
    """
    where = _lone_surrogate_at(body, "")
    if where is not None:
        param = where.split(".", 1)[0].split("[", 1)[0]
        raise RequestFieldError(param, f"the lone UTF-16 surrogate in {where} is not valid Unicode")


def without_nulls(body: Any, names: frozenset[str]) -> Any:
    """`body` without those of `names` sent as null: OpenAI's API (and vLLM's server) take null
    for them, meaning the default, and the official client sends it for an explicit None."""
    if isinstance(body, dict):
        return {k: v for k, v in body.items() if not (v is None and k in names)}
    return body


class RequestBody(BaseModel):
    """A request's JSON body: unknown fields ignored, as vLLM's server does, and a lone surrogate
    anywhere refused (`check_valid_unicode`)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        check_valid_unicode(body)
        return body


class SamplingFields(RequestBody):
    """Fields chat and completions share."""

    # Python's JSON reads NaN, Infinity and 1e999; refused as what they are, not as out of range.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    # Fields a request may send as null for their default (nullable in OpenAI's API or vLLM's).
    null_means_unset: ClassVar[frozenset[str]] = frozenset({
        "n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "echo", "stop_token_ids",
        "return_tokens_as_token_ids"})

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, body: Any) -> Any:
        return without_nulls(body, cls.null_means_unset)

    # vLLM's fields that change its output and that are not served here, each with the values
    # that ask for nothing (which pass): ignored, they would answer another request than the
    # one sent: beam search, logprobs of named tokens, repetition detection, and the arguments
    # of custom logits processors.
    unserved_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "use_beam_search": (None, False), "logprob_token_ids": (None, []),
        "repetition_detection": (None,), "vllm_xargs": (None, {})}
    # What to send instead, where the API has it.
    unserved_field_hints: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved_fields(cls, body: Any) -> Any:
        if isinstance(body, dict):
            for name, values_asking_nothing in cls.unserved_fields.items():
                if name in body and not any(body[name] == value and type(body[name]) is type(value)
                                            for value in values_asking_nothing):
                    raise RequestFieldError(name, "is not supported by this server"
                                                  + cls.unserved_field_hints.get(name, ""))
        return body

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions, accepted as its own server accepts them.
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=MIN_POSITIVE_FLOAT32, le=MAX_FLOAT32)
    min_tokens: int = Field(0, ge=0, le=MAX_UINT32)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    include_stop_str_in_output: bool = False
    # vLLM's default --max-logprobs is 20; non-streamed only (vLLM's rule: 0 is let through).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's: keep this many of the prompt's tokens (-1: as many as the context holds), the
    # last ones unless `truncation_side` is "right" (vLLM loads generating models' tokenizers
    # with truncation on the left).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: logprob tokens written as "token_id:<id>", for tokens whose text is not whole.
    return_tokens_as_token_ids: bool = False
    # vLLM's: only these tokens may be sampled; an empty list is refused, as vLLM refuses it.
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    # vLLM's: words never generated (the engine forbids the token that would complete one).
    bad_words: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    # vLLM's: off, adjacent special tokens shown in the text get no space between them, which
    # the tokenizer service's detokenization does not do; refused then (below).
    spaces_between_special_tokens: bool = True
    # vLLM's: the prompt's cached KV is shared only with requests of the same salt.
    cache_salt: CacheSalt | None = None
    # vLLM's: lower is served first where the engines schedule by priority (`backport up
    # --scheduling-policy priority`); else ignored, as vLLM ignores it.
    priority: int = Field(0, ge=-(2**63), lt=2**63)
    # vLLM's: the model reasons for at most this many tokens (-1: no limit); a whole number,
    # as vLLM takes it.
    thinking_token_budget: Annotated[int, Field(strict=True, ge=-1, le=MAX_UINT32)] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> SamplingFields:
        if self.stream and self.prompt_logprobs:
            raise RequestFieldError("prompt_logprobs", "not available when `stream=True`")
        return self

    @model_validator(mode="after")
    def _special_tokens_spaced(self) -> SamplingFields:
        if not self.spaces_between_special_tokens and not self.skip_special_tokens:
            raise RequestFieldError("spaces_between_special_tokens",
                                    "false is not supported by this server")
        return self

    @model_validator(mode="after")
    def _stream_options_only_streamed(self) -> SamplingFields:
        # As OpenAI's API and vLLM's server: options for a stream that is not one are a mistake
        # the client should hear of (an empty object, which asks for nothing, passes).
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise RequestFieldError("stream_options", "only allowed when `stream=True`")
        return self

    @model_validator(mode="after")
    def _min_tokens_within_the_limit(self) -> SamplingFields:
        # vLLM's sampling params refuse it too, in a message the gateway cannot tie to a field.
        limit = self.token_limit
        if limit is not None and self.min_tokens > limit:
            raise RequestFieldError("min_tokens", f"must be at most the token limit ({limit}), "
                                                  f"got {self.min_tokens}")
        return self

    @property
    def token_limit(self) -> int | None:
        """The most tokens a choice may generate, as the request caps them."""
        raise NotImplementedError

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            # ASCII digits only: `str.isdigit` takes "²", which `int` refuses.
            if not (token.isascii() and token.isdigit()) or int(token) > MAX_UINT32:
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values lie in [-100, 100], got {bias}")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return self.stop  # type: ignore[return-value]  # normalised by the validator

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def include_continuous_usage(self) -> bool:
        """vLLM's extension: every chunk carries the usage so far (with include_usage only)."""
        return self.include_usage and bool(self.stream_options and
                                           self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    # OpenAI's deprecated forerunners of `tools` and `tool_choice`, which vLLM ignores: refused,
    # or the model would answer without the functions the client gave it.
    unserved_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        **SamplingFields.unserved_fields, "functions": (None, []), "function_call": (None, "none")}
    unserved_field_hints: ClassVar[dict[str, str]] = {
        "functions": "; give them as `tools`", "function_call": "; use `tool_choice`"}

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: RequestedEffort | None = None
    thinking: bool | dict[str, Any] | None = None
    # vLLM's: false leaves the reasoning out of the answer, and the logprobs, which would show it.
    include_reasoning: bool = True
    prompt_cache_key: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the tokenizer's special tokens (BOS) on top of the template's; off, as in vLLM.
    add_special_tokens: bool = False
    # vLLM's: the last message's content leads each choice's when it has the response's role.
    echo: bool = False
    # vLLM's: refused, as vLLM's server refuses it unless started to trust request templates.
    chat_template: str | None = None

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] has no role")
        return messages

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise RequestFieldError("top_logprobs", "requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self) -> ChatCompletionRequest:
        # As vLLM: only an add_generation_prompt the client sent conflicts; the default yields.
        if (self.continue_final_message and self.add_generation_prompt
                and "add_generation_prompt" in self.model_fields_set):
            raise RequestFieldError("continue_final_message",
                                    "cannot be true together with add_generation_prompt")
        return self

    @model_validator(mode="after")
    def _no_request_chat_template(self) -> ChatCompletionRequest:
        # Ignoring it would answer a prompt other than the one the client asked for.
        if self.chat_template is not None:
            raise RequestFieldError("chat_template", "a chat template sent with the request is "
                                                     "not used here: chats render with the model's own")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError(f"expected \"none\", \"auto\" or \"required\", got {choice!r}")
        if isinstance(choice, dict) and not (
                choice.get("type") == "function" and isinstance(choice.get("function"), dict)
                and isinstance(choice["function"].get("name"), str)):
            raise ValueError('a named choice is {"type": "function", "function": {"name": ...}}')
        return choice

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> ChatCompletionRequest:
        if self.tool_choice in (None, "none"):
            return self
        if not self.tools:
            raise RequestFieldError("tool_choice", f"{self.tool_choice!r} needs tools")
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            names = [t.get("function", {}).get("name") for t in self.tools
                     if isinstance(t, dict) and isinstance(t.get("function"), dict)]
            if name not in names:
                raise RequestFieldError("tool_choice", f"names {name!r}, which is not among the tools")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        # As vLLM: `echo` asks for the prompt's logprobs too, which a stream leaves out.
        if self.prompt_logprobs is None and self.echo and not self.stream:
            return self.top_logprobs or 0
        return self.prompt_logprobs

    @property
    def response_role(self) -> str:
        """The role of the message answered, as vLLM's server gives it: the assistant's, unless
        no generation prompt was asked for: the output then goes on with the last message."""
        return "assistant" if self.add_generation_prompt else self.messages[-1]["role"]

    @property
    def echoed_content(self) -> str:
        """With `echo`, the last message's text when it has the response's role (vLLM's rule),
        its text parts joined by newlines as the chat template reads them."""
        last = self.messages[-1]
        if not self.echo or last["role"] != self.response_role:
            return ""
        content = last.get("content")
        if isinstance(content, list):
            return "\n".join(part.get("text") or "" for part in content
                             if isinstance(part, dict) and part.get("type") == "text")
        return content if isinstance(content, str) else ""


class CompletionRequest(SamplingFields):
    # OpenAI's API and vLLM's server read a null max_tokens as 16 here, not as no limit.
    null_means_unset = SamplingFields.null_means_unset | {"max_tokens"}

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, token ids, or a batch of either")
    # 0 only with `echo`: the prompt alone comes back (scoring it by its logprobs).
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    # vLLM's: text prompts get the tokenizer's special tokens (BOS), unless turned off.
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        # Checked by hand: pydantic's report for a union names the first member it tried.
        def is_ids(value: Any) -> bool:
            return isinstance(value, list) and bool(value) and all(
                type(i) is int and 0 <= i <= MAX_UINT32 for i in value)

        def is_text(value: Any) -> bool:
            return isinstance(value, str) and bool(value)

        if not (is_text(prompt) or is_ids(prompt) or (
                isinstance(prompt, list) and bool(prompt)
                and (all(is_text(p) for p in prompt) or all(is_ids(p) for p in prompt)))):
            raise ValueError("must be a non-empty string, a list of token ids (0 to 2**32 - 1), "
                             "or a non-empty list of either")
        return prompt

    @model_validator(mode="after")
    def _no_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise RequestFieldError("max_tokens", "0 is only allowed with echo (to score the prompt)")
        return self

    @property
    def is_echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the response holds the prompt and nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def token_limit(self) -> int | None:
        # The engine generates at least one token; an echo-only response leaves it out, as vLLM's.
        return 1 if self.is_echo_only else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        # As vLLM: echoed prompt tokens get logprobs as the generated ones do.
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "tool_calls", "abort"]
