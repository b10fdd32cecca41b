from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RenderChatRequest(_message.Message):
    __slots__ = ("messages_json", "tools_json", "template_kwargs_json", "add_generation_prompt", "continue_final_message", "add_special_tokens")
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    messages_json: str
    tools_json: str
    template_kwargs_json: str
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    def __init__(self, messages_json: _Optional[str] = ..., tools_json: _Optional[str] = ..., template_kwargs_json: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class RenderChatResponse(_message.Message):
    __slots__ = ("token_ids", "prompt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class DecodeTokensRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeTokensInContextRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenInContext]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenInContext, _Mapping]]] = ...) -> None: ...

class TokenInContext(_message.Message):
    __slots__ = ("token_id", "context_token_ids")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_id: _Optional[int] = ..., context_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeTokensResponse(_message.Message):
    __slots__ = ("texts", "utf8")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    UTF8_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    utf8: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., utf8: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("skip_special_tokens", "token_ids")
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    skip_special_tokens: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, skip_special_tokens: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class SequenceStep(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "open", "skip_special_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    open: bool
    skip_special_tokens: bool
    def __init__(self, sequence_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., open: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeSequencesRequest(_message.Message):
    __slots__ = ("steps", "closed_sequence_ids")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[SequenceStep]
    closed_sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[_Iterable[_Union[SequenceStep, _Mapping]]] = ..., closed_sequence_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SequenceText(_message.Message):
    __slots__ = ("text", "error", "error_code")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    text: str
    error: str
    error_code: int
    def __init__(self, text: _Optional[str] = ..., error: _Optional[str] = ..., error_code: _Optional[int] = ...) -> None: ...

class DetokenizeSequencesResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedCompositeFieldContainer[SequenceText]
    def __init__(self, texts: _Optional[_Iterable[_Union[SequenceText, _Mapping]]] = ...) -> None: ...

class GetTokenizerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("tokenizer", "vocab_size", "eos_token_ids", "bos_token_id", "chat_format")
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    tokenizer: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    chat_format: str
    def __init__(self, tokenizer: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., chat_format: _Optional[str] = ...) -> None: ...
