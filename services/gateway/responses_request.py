"""The body of `POST /v1/responses` and its reading as a chat completion request.

The Responses API is served on the chat path, as vLLM's server does without harmony: `input`
items become chat messages (`instructions` a system message first), flat function tools become
chat tools, `text.format` becomes `response_format`, `reasoning.effort` `reasoning_effort`.
Conversion follows vLLM's: a `reasoning` item opens an assistant message (its text as the
message's reasoning), a following assistant message or `function_call` item joins it (text only
before calls), and a `function_call_output` item is a tool message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError,
                      field_validator, model_validator)

from services.gateway.errors import InvalidRequestError, RequestFieldError
from services.gateway.schemas import ChatCompletionRequest

# Chat request fields a Responses field turns into, for errors the chat path raises.
_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                     "response_format": "text", "reasoning_effort": "reasoning"}


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


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[TextPart] | str

    def text_content(self) -> str | list[dict[str, str]]:
        if isinstance(self.content, str):
            return self.content
        return [{"type": "text", "text": part.text} for part in self.content]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: list[TextPart] | str

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        # The content is the reasoning itself; the summary stands in for it when absent.
        parts = self.content or self.summary
        return "\n".join(part.text for part in parts)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(lambda item: item.get("type", "message") if isinstance(item, dict)
                  else getattr(item, "type", None))]


_INPUT_ITEM = TypeAdapter(InputItem)


def _item(index: int, item: Any) -> MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem:
    # One item at a time, so that an error names the item rather than the union's members.
    try:
        return _INPUT_ITEM.validate_python(item)
    except ValidationError as error:
        first = error.errors()[0]
        # The location starts with the item's tag; union members name themselves as `list[...]`.
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                        for part in first["loc"][1:] if isinstance(part, int) or "[" not in part)
        raise RequestFieldError("input", f"input[{index}]{where}: {first['msg']}") from error


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


class ReasoningConfig(_Item):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`; unknown fields are ignored, as on the chat path."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    reasoning: ReasoningConfig | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    previous_response_id: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        # Checked before the union: pydantic's report for a bad tag names neither field nor item.
        if isinstance(value, list):
            if not value:
                raise RequestFieldError("input", "must not be an empty list")
            for index, item in enumerate(value):
                kind = item.get("type", "message") if isinstance(item, dict) else None
                if kind not in ITEM_TYPES:
                    raise RequestFieldError("input", f"input[{index}]: unsupported item type {kind!r}; "
                                                     f"expected one of {', '.join(ITEM_TYPES)}")
                if kind == "reasoning" and item.get("encrypted_content"):
                    raise RequestFieldError("input", f"input[{index}]: encrypted reasoning is not supported")
            return [_item(index, item) for index, item in enumerate(value)]
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for index, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise RequestFieldError("tools", f"tools[{index}]: only function tools are supported, "
                                                 f"got type {kind!r}")
        return value

    @model_validator(mode="after")
    def _servable(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise RequestFieldError("previous_response_id",
                                    "responses are not stored here; send the whole conversation in input")
        if self.tool_choice not in ("none", "auto") and not self.tools:
            raise RequestFieldError("tool_choice", "forcing a call needs tools")
        if isinstance(self.tool_choice, NamedFunctionChoice) and self.tool_choice.name not in {
                tool.name for tool in self.tools}:
            raise RequestFieldError("tool_choice",
                                    f"names {self.tool_choice.name!r}, which is not among the tools")
        if self.text.format.type == "json_schema" and self.text.format.schema_ is None:
            raise RequestFieldError("text", "format json_schema needs a schema")
        return self

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

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this response is generated as; errors name our fields."""
        fields: dict[str, Any] = {
            "model": self.model, "messages": self.chat_messages(), "stream": self.stream,
            "max_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "user": self.user, "prompt_cache_key": self.prompt_cache_key,
            "parallel_tool_calls": self.parallel_tool_calls}
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
            # Our own checks leave little for the chat request's to find: a lone surrogate.
            first = error.errors()[0]
            cause = first.get("ctx", {}).get("error")
            chat_param = cause.param if isinstance(cause, RequestFieldError) else ".".join(
                str(part) for part in first.get("loc", ()))
            problem = str(cause).removeprefix(f"{chat_param}: ") if cause else first["msg"]
            param = responses_param(chat_param)
            raise InvalidRequestError(f"{param}: {problem}", param=param) from error


def _chat_message(item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                  previous: dict[str, Any] | None) -> dict[str, Any] | None:
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
