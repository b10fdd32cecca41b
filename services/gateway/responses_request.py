"""The body of `POST /v1/responses` and its reading as a chat completion request.

The Responses API is served on the chat path, as vLLM's server does without harmony: `input`
items become chat messages (`instructions` a system message first), flat function tools become
chat tools, `text.format` becomes `response_format`, `reasoning.effort` `reasoning_effort`.
Conversion follows vLLM's: a `reasoning` item opens an assistant message (its text as the
message's reasoning), a following assistant message or `function_call` item joins it (text only
before calls), and a `function_call_output` item is a tool message. As in vLLM, a last assistant
message or reasoning item marked `in_progress` or `incomplete` is continued rather than answered,
and vLLM's sampling fields (`stop`, `seed`, `top_k`, ...) are read as on the chat path.
`include` of `message.output_text.logprobs` asks the chat request for logprobs, `top_logprobs`
alternatives each; without it `top_logprobs` asks for nothing, as in vLLM.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError,
                      field_validator, model_validator)

from services.gateway.errors import InvalidRequestError, RequestFieldError, field_path
from services.gateway.reasoning_effort import RequestedEffort
from services.gateway.schemas import (CacheSalt, ChatCompletionRequest, Metadata, RequestBody,
                                      without_nulls)

# Chat request fields a Responses field turns into, for errors the chat path raises.
_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                     "response_format": "text", "reasoning_effort": "reasoning"}

# Fields that need state this server does not keep (stored prompts): answering without them
# would silently drop what they refer to.
_STATEFUL_FIELDS = {"prompt": "stored prompts are not supported; send instructions and input"}
# The `include` value that asks for the output text's logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` values OpenAI defines for output this server never makes (built-in tool results,
# image urls, encrypted reasoning): asking for them changes nothing, as for a model without them.
_UNMADE_INCLUDES = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "reasoning.encrypted_content", "web_search_call.action.sources",
    "web_search_call.results"})


# Fields OpenAI's Responses API lets a client send as null for their default.
_NULL_MEANS_UNSET = frozenset({"background", "parallel_tool_calls", "stream", "text"})
# vLLM's fields that its Responses API takes as its chat API does: carried onto the chat request,
# which checks them (`vllm_xargs`, not served, is a 400 there, as on chat).
_VLLM_CHAT_FIELDS = frozenset({
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
    "include_reasoning", "chat_template_kwargs", "structured_outputs", "priority", "vllm_xargs"})
# Chat request fields an error's message may name besides its param ("cannot be combined with
# response_format"); `messages` is left out, being an ordinary word too.
_CHAT_FIELD_WORDS = re.compile(r"\b(?:max_tokens|response_format|reasoning_effort)\b")


def responses_message(chat_message: str) -> str:
    """An error message of the chat path, naming the Responses fields the client wrote."""
    return _CHAT_FIELD_WORDS.sub(lambda match: _RESPONSES_PARAMS[match[0]], chat_message)


def responses_param(chat_param: str | None) -> str | None:
    """The Responses field behind a chat request field an error names."""
    if chat_param is None:
        return None
    head, dot, rest = chat_param.partition(".")
    head, bracket, index = head.partition("[")
    return _RESPONSES_PARAMS.get(head, head) + bracket + index + dot + rest


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Item):
    """An assistant message's refusal, as this API returns it and clients replay it."""

    type: Literal["refusal"]
    refusal: str


InputItemStatus = Literal["in_progress", "completed", "incomplete"]
# The statuses of an item the client marks unfinished (vLLM continues such a last
# assistant item).
_UNFINISHED = ("in_progress", "incomplete")


class _InputItem(_Item):
    # Kept as given, or made when the item is stored (`input_items`), for the items listing.
    id: str | None = None


class MessageItem(_InputItem):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[TextPart | RefusalPart] | str
    status: InputItemStatus | None = None

    def text_content(self) -> str | list[dict[str, str]]:
        if isinstance(self.content, str):
            return self.content
        return [{"type": "text", "text": part.text} if isinstance(part, TextPart)
                else {"type": "refusal", "refusal": part.refusal} for part in self.content]


class FunctionCallItem(_InputItem):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_InputItem):
    type: Literal["function_call_output"]
    call_id: str
    output: list[TextPart] | str

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_InputItem):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: InputItemStatus | None = None

    def text(self) -> str:
        # The content is the reasoning itself; the summary stands in for it when absent.
        parts = self.content or self.summary
        return "\n".join(part.text for part in parts)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# The prefix of the id each type of input item is stored with where the client gave none.
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                     "reasoning": "rs"}
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(lambda item: item.get("type", "message") if isinstance(item, dict)
                  else getattr(item, "type", None))]


_INPUT_ITEM = TypeAdapter(InputItem)
InputItemModel = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def parse_input_items(value: list[Any], *, field: str) -> list[InputItemModel]:
    """The input items of a request's `field`; a RequestFieldError names the item at fault."""
    for index, item in enumerate(value):
        # Checked before the union: pydantic's report for a bad tag names neither field nor item.
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEM_TYPES:
            raise RequestFieldError(field, f"unsupported item type {kind!r}; expected one of "
                                           f"{', '.join(ITEM_TYPES)}", where=f"{field}[{index}]")
        if kind == "reasoning" and item.get("encrypted_content"):
            raise RequestFieldError(field, "encrypted reasoning is not supported",
                                    where=f"{field}[{index}]")
    return [_item(field, index, item) for index, item in enumerate(value)]


def stored_items(items: list[InputItemModel]) -> list[dict[str, Any]]:
    """The items as a store keeps them: each with an `id`, a new one where the client gave none."""
    return [{"id": f"{_ITEM_ID_PREFIXES[item.type]}_{uuid.uuid4().hex}",
             **item.model_dump(exclude_none=True)} for item in items]


def _item(field: str, index: int, item: Any) -> InputItemModel:
    # One item at a time, so that an error names the item rather than the union's members.
    try:
        return _INPUT_ITEM.validate_python(item)
    except ValidationError as error:
        first = error.errors()[0]
        # The location starts with the item's tag.
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                        for part in field_path(first["loc"][1:]))
        raise RequestFieldError(field, first["msg"], where=f"{field}[{index}]{where}") from error


class FunctionTool(_Item):
    """A function tool in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunctionChoice(_Item):
    type: Literal["function"]
    name: str


class TextFormat(_Item):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Item):
    format: TextFormat = Field(default_factory=TextFormat)

    # vLLM takes a null format as none given.
    @model_validator(mode="before")
    @classmethod
    def _null_format_means_text(cls, body: Any) -> Any:
        return without_nulls(body, {"format"})


class ReasoningConfig(_Item):
    effort: RequestedEffort | None = None
    summary: str | None = None


class ConversationRef(_Item):
    id: str


class ResponsesRequest(RequestBody):
    """`POST /v1/responses`; unknown fields are ignored, as on the chat path (kept as extras,
    where vLLM's sampling fields are read from). Checked for lone surrogates whole, not only
    what the chat request carries on: fields only echoed back (`metadata`) would fail as the
    response is encoded, a 500 or a stream cut short."""

    # Python's JSON reads NaN, Infinity and 1e999; refused as what they are, not as out of range.
    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    reasoning: ReasoningConfig | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    stream: bool = False
    # Answered at once, `queued`, and generated after: polled by GET, stopped by cancel.
    background: bool = False
    user: str | None = None
    metadata: Metadata | None = None
    # OpenAI's default: stored, so a later request may continue it by `previous_response_id`.
    store: bool | None = None
    previous_response_id: str | None = None
    # Its items go before the input, and the response's turn is added to it once made.
    conversation: str | ConversationRef | None = None
    prompt_cache_key: str | None = None
    cache_salt: CacheSalt | None = None
    include: list[str] | None = None
    # OpenAI's bounds, vLLM's default --max-logprobs; checked whether or not `include` asks.
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _stateless(cls, body: Any) -> Any:
        given = body if isinstance(body, dict) else {}
        for name, problem in _STATEFUL_FIELDS.items():
            if given.get(name) not in (None, False):
                raise RequestFieldError(name, problem)
        return body

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, body: Any) -> Any:
        return without_nulls(body, _NULL_MEANS_UNSET)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        # Checked before the union: pydantic's report for a bad tag names neither field nor item.
        if not isinstance(value, str | list):
            raise RequestFieldError("input", "must be a string or a list of input items")
        if isinstance(value, list):
            if not value:
                raise RequestFieldError("input", "must not be an empty list")
            return parse_input_items(value, field="input")
        return value

    @field_validator("conversation", mode="before")
    @classmethod
    def _conversation_shape(cls, value: Any) -> Any:
        # Checked by hand: pydantic's report for the union names only its first member.
        if value is None or isinstance(value, str) or (isinstance(value, dict)
                                                       and isinstance(value.get("id"), str)):
            return value
        raise RequestFieldError("conversation", 'must be a conversation id or {"id": ...}')

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for index, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise RequestFieldError("tools", f"tools[{index}]: only function tools are supported, "
                                                 f"got type {kind!r}")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        # Checked by hand: pydantic's report for the union names only the strings.
        is_named_function = (isinstance(value, dict) and value.get("type") == "function"
                             and isinstance(value.get("name"), str))
        if value in ("none", "auto", "required") or is_named_function:
            return value
        if not isinstance(value, dict):
            got = repr(value)
        elif value.get("type") == "function":
            got = "a function choice without a name"
        else:
            got = f"type {value.get('type')!r}"
        raise RequestFieldError("tool_choice", '"none", "auto", "required" or {"type": "function", '
                                               f'"name": ...}} are supported, got {got}')

    @field_validator("include")
    @classmethod
    def _makeable_includes(cls, values: list[str] | None) -> list[str] | None:
        for index, value in enumerate(values or []):
            if value != LOGPROBS_INCLUDE and value not in _UNMADE_INCLUDES:
                raise RequestFieldError("include", f"include[{index}]: unknown value {value!r}")
        return values

    @model_validator(mode="after")
    def _servable(self) -> ResponsesRequest:
        if self.previous_response_id is not None and self.conversation is not None:
            raise RequestFieldError("conversation", "cannot be given with previous_response_id: "
                                                    "each names the history to go on from")
        # After stored items, a call output may answer one of their calls (`after` checks).
        if isinstance(self.input, list) and self.history_source is None:
            check_call_outputs(self.input, known_call_ids=set())
        if self.tool_choice not in ("none", "auto") and not self.tools:
            raise RequestFieldError("tool_choice", "forcing a call needs tools")
        if isinstance(self.tool_choice, NamedFunctionChoice) and self.tool_choice.name not in {
                tool.name for tool in self.tools}:
            raise RequestFieldError("tool_choice",
                                    f"names {self.tool_choice.name!r}, which is not among the tools")
        if self.text.format.type == "json_schema" and self.text.format.schema_ is None:
            raise RequestFieldError("text", "format json_schema needs a schema")
        if self.text.format.type == "json_schema" and self.text.format.name is None:
            raise RequestFieldError("text", "format json_schema needs a name, as OpenAI and vLLM ask")
        if self.background and self.store is False:
            raise RequestFieldError("background", "a background response is stored to be polled; "
                                                  "it cannot have store: false")
        return self

    @property
    def includes_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @property
    def history_source(self) -> Literal["previous_response_id", "conversation"] | None:
        """The field naming stored items that go before the input, if any."""
        if self.previous_response_id is not None:
            return "previous_response_id"
        return "conversation" if self.conversation is not None else None

    def input_items(self) -> list[dict[str, Any]]:
        """The request's own input as items, as a store keeps them (`stored_items`)."""
        return stored_items(self._own_items())

    def _own_items(self) -> list[InputItemModel]:
        # A string input is one user message.
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    def after(self, history: list[dict[str, Any]]) -> ResponsesRequest:
        """This request with stored items (`history_source`'s) before its own input."""
        source = self.history_source
        try:
            earlier = [_INPUT_ITEM.validate_python(item) for item in history]
        except ValidationError as error:
            # An output item no request could send (a call with an empty name, from a parser).
            raise InvalidRequestError(f"{source}: the stored conversation cannot be continued: "
                                      f"{error.errors()[0]['msg']}", param=source) from None
        own = self._own_items()
        try:
            check_call_outputs(own, known_call_ids=call_ids(history))
        except RequestFieldError as error:
            raise InvalidRequestError(str(error), param=error.param) from None
        return self.model_copy(update={"input": [*earlier, *own]})

    @property
    def num_items(self) -> int:
        return 1 if isinstance(self.input, str) else len(self.input)

    def without_first_items(self, count: int) -> ResponsesRequest:
        """This request with its first `count` input items dropped (`truncation: "auto"`), and
        the call outputs whose calls went with them: nothing would answer them."""
        if count == 0 or isinstance(self.input, str):
            return self
        kept = self.input[count:]
        calls = {item.call_id for item in kept if isinstance(item, FunctionCallItem)}
        return self.model_copy(update={"input": [
            item for item in kept
            if not (isinstance(item, FunctionCallOutputItem) and item.call_id not in calls)]})

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            message = _chat_message(item, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
        return messages

    def _continues_final_message(self) -> bool:
        """vLLM's partial completion: the model goes on with a last assistant message or reasoning
        the client marks unfinished (a response cut short, replayed), instead of answering it."""
        if isinstance(self.input, str):
            return False
        last = self.input[-1]
        if isinstance(last, MessageItem) and last.role != "assistant":
            return False
        return isinstance(last, MessageItem | ReasoningItem) and last.status in _UNFINISHED

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this response is generated as; errors name our fields."""
        fields: dict[str, Any] = {
            **{name: value for name, value in (self.model_extra or {}).items()
               if name in _VLLM_CHAT_FIELDS},
            "model": self.model, "messages": self.chat_messages(), "stream": self.stream,
            "continue_final_message": self._continues_final_message(),
            "max_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "user": self.user, "prompt_cache_key": self.prompt_cache_key,
            "cache_salt": self.cache_salt, "parallel_tool_calls": self.parallel_tool_calls}
        if self.includes_logprobs:
            fields |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.tools:
            fields["tools"] = [tool.chat_tool() for tool in self.tools]
            fields["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str) else
                                     {"type": "function", "function": {"name": self.tool_choice.name}})
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        text_format = self.text.format
        if text_format.type == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": text_format.model_dump(
                include={"name", "description", "schema_", "strict"}, by_alias=True, exclude_none=True)}
        elif text_format.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as error:
            # Our own checks leave the chat request's nothing known to find; should the two
            # differ, the client still gets a 400 naming its own field.
            first = error.errors()[0]
            cause = first.get("ctx", {}).get("error")
            chat_param = cause.param if isinstance(cause, RequestFieldError) else ".".join(
                str(part) for part in field_path(first.get("loc", ())))
            problem = str(cause).removeprefix(f"{chat_param}: ") if cause else first["msg"]
            param = responses_param(chat_param)
            raise InvalidRequestError(f"{param}: {problem}", param=param) from error


class InputTokensRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens`: a response's request, counted rather than made; without
    a `model`, the served one."""

    model: str | None = None  # type: ignore[assignment]


def check_call_outputs(items: list[InputItemModel], *, known_call_ids: set[str],
                       field: str = "input") -> None:
    """Each `function_call_output` answers a `function_call` item before it (or one of
    `known_call_ids`, the calls of stored items before them), as OpenAI requires: a chat template
    would render an answer to no call, or fail on it. The request's `field` holds `items`."""
    call_ids = set(known_call_ids)
    for index, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            call_ids.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in call_ids:
            raise RequestFieldError(field, f"no function_call item before it has call_id "
                                           f"{item.call_id!r}", where=f"{field}[{index}]")


def call_ids(items: list[dict[str, Any]]) -> set[str]:
    """The call ids of the stored `function_call` items among `items`."""
    return {item["call_id"] for item in items if item.get("type") == "function_call"}


def _chat_message(item: InputItemModel, previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat message `item` adds, or None when it joins the `previous` assistant message."""
    joinable = previous if previous is not None and previous["role"] == "assistant" else None
    match item:
        case FunctionCallItem():
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if joinable is not None:
                joinable.setdefault("tool_calls", []).append(call)
                return None
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        case FunctionCallOutputItem():
            return {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
        case ReasoningItem():
            # Reasoning comes first in a turn, so it always opens one.
            return {"role": "assistant", "content": None, "reasoning": item.text()}
        case MessageItem(role="assistant"):
            if joinable is not None and joinable.get("content") is None and "tool_calls" not in joinable:
                joinable["content"] = item.text_content()
                return None
            return {"role": "assistant", "content": item.text_content()}
        case MessageItem():
            return {"role": item.role, "content": item.text_content()}
