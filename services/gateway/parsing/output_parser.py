"""The per-choice streaming parser: raw model text in, OpenAI message deltas out.

One state machine serves streaming and non-streaming alike (non-streaming is one `feed` of the
whole text, then `finish`). Text is classified by markers found with `MarkerSet.find`, which holds
back any tail that could still grow into a marker, so the result is the same for every way the
output is split into deltas: one character at a time, a whole tool call in one delta (as
speculative decoding produces), or anything between.

Rules that hold for every format:
- Markup never reaches `content` or `reasoning_content`: recognised tags are consumed, stray
  closing tags are dropped, and a marker cut off by the end of the output is dropped. Once the
  answer has begun, though, a stray closing tag or a `<think>` is the answer's own text (it may
  explain these very tags), as vLLM keeps it. Inside the reasoning, the tags that end it are
  `</think>`, a terminator and the wrapper the template writes around tool calls
  (`starts_ending_reasoning`); any other tool-call markup there (a bare `<function=...>`, a
  closing tag) is the reasoning's own text, as in vLLM's grammars.
- A tool call is released only once its closing tag has arrived: its first delta carries index,
  id, type and name, the next its complete arguments (a JSON object, values typed by the tool
  schema). A call the model itself ended without its closing tag (the output stopped, or a
  terminator came, between arguments) is released at that end, as vLLM releases it. A call cut
  off by `max_tokens` or an abort, or one the output ends inside an argument of, is never sent
  (vLLM sends what it has), so the stream and the final message agree and no client ever
  executes half a call. With parallel tool calls off, only the first call is released (vLLM
  keeps only index 0).
- Tool calls end the turn: text between and after calls is dropped, as the templates never put
  any there.
- Leading and trailing whitespace of each reasoning or content stretch is dropped (the
  templates put newlines around the tags); whitespace inside is kept, held back until
  non-whitespace text follows it. A second reasoning block (only whitespace since the first
  closed) continues the reasoning after a blank line.
- After a terminator (the family's end-of-turn special token) everything is ignored.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Mapping, Sequence
from enum import Enum, auto
from typing import Any

from services.gateway.parsing.argument_typing import ToolSchemas, arguments_json
from services.gateway.parsing.formats import ReasoningFormat, ToolCallFormat
from services.gateway.parsing.markers import MarkerSet
from services.gateway.parsing.messages import (
    AssistantMessage,
    MessageDelta,
    ToolCall,
    ToolCallDelta,
)
from services.gateway.parsing.registry import reasoning_format, tool_call_format


class _Mode(Enum):
    REASONING = auto()
    CONTENT = auto()
    BETWEEN_CALLS = auto()
    IN_CALL = auto()
    IN_VALUE = auto()  # inside a call, inside one argument's value
    ENDED = auto()


class _Action(Enum):
    DROP = auto()
    STRAY = auto()  # a closing tag with nothing open: dropped, or the answer's text once it began
    OPEN_REASONING = auto()
    CLOSE_REASONING = auto()
    OPEN_BLOCK = auto()
    OPEN_CALL = auto()
    CLOSE_CALL = auto()
    OPEN_VALUE = auto()
    CLOSE_VALUE = auto()
    END_TURN = auto()


# Between the texts of two reasoning blocks, which would otherwise run into one word.
_REASONING_BLOCK_SEPARATOR = "\n\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@functools.cache
def _marker_table(
    reasoning: ReasoningFormat | None, tools: ToolCallFormat | None
) -> dict[_Mode, dict[str, _Action]]:
    """Which markers mean what in each mode; later entries win where a tag has two roles."""
    terminators = {
        *(reasoning.terminators if reasoning else ()),
        *(tools.terminators if tools else ()),
    }
    ends_turn = dict.fromkeys(terminators, _Action.END_TURN)
    strays = dict.fromkeys(tools.stray_markup if tools else (), _Action.STRAY)
    opens_tools = {
        **dict.fromkeys(tools.block_starts if tools else (), _Action.OPEN_BLOCK),
        **dict.fromkeys(tools.call_starts if tools else (), _Action.OPEN_CALL),
    }
    opens_tools_from_reasoning = {
        marker: action
        for marker, action in opens_tools.items()
        if marker in (tools.starts_ending_reasoning if tools else ())
    }
    reasoning_tags = (
        {reasoning.start: _Action.OPEN_REASONING, reasoning.end: _Action.DROP} if reasoning else {}
    )
    ends_inside_values = tuple(
        end for end in tools.call_ends if end not in tools.call_ends_outside_values
    ) if tools else ()
    return {
        _Mode.CONTENT: {**strays, **reasoning_tags, **opens_tools, **ends_turn},
        _Mode.REASONING: {
            **(
                {reasoning.start: _Action.DROP, reasoning.end: _Action.CLOSE_REASONING}
                if reasoning
                else {}
            ),
            **opens_tools_from_reasoning,
            **ends_turn,
        },
        _Mode.BETWEEN_CALLS: {
            **dict.fromkeys(tools.call_starts if tools else (), _Action.OPEN_CALL),
            **ends_turn,
        },
        _Mode.IN_CALL: {
            **dict.fromkeys(tools.value_starts if tools else (), _Action.OPEN_VALUE),
            **dict.fromkeys(tools.call_restarts if tools else (), _Action.OPEN_CALL),
            **dict.fromkeys(tools.call_ends if tools else (), _Action.CLOSE_CALL),
            **ends_turn,
        },
        _Mode.IN_VALUE: {
            **dict.fromkeys(tools.value_starts if tools else (), _Action.OPEN_VALUE),
            **dict.fromkeys(tools.value_ends if tools else (), _Action.CLOSE_VALUE),
            **dict.fromkeys(tools.call_restarts if tools else (), _Action.OPEN_CALL),
            **dict.fromkeys(ends_inside_values, _Action.CLOSE_CALL),
            **ends_turn,
        },
        _Mode.ENDED: {},
    }


@functools.cache
def _marker_sets(
    reasoning: ReasoningFormat | None, tools: ToolCallFormat | None
) -> dict[_Mode, MarkerSet]:
    # Cached: a parser is made per choice of every request, the formats are fixed.
    return {mode: MarkerSet(actions) for mode, actions in _marker_table(reasoning, tools).items()}


class ChatOutputParser:
    """Parses one choice's output text, incrementally.

    `thinking=True` means the prompt ended with `<think>`, so the output starts inside the
    reasoning; it has no effect without a reasoning parser. `allow_tool_calls=False` (a request
    without tools, or `tool_choice: "none"`) still consumes tool-call markup, so none leaks into
    the content, but releases no call; `allow_parallel_tool_calls=False` (the request's
    `parallel_tool_calls: false`) releases the first call only. Call `feed` with each new piece
    of text, `finish` once at the end of the stream, then `message()` for the final message.
    """

    def __init__(
        self,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = False,
        make_call_id: Callable[[], str] = new_call_id,
        allow_tool_calls: bool = True,
        allow_parallel_tool_calls: bool = True,
    ) -> None:
        self._allow_tool_calls = allow_tool_calls
        self._allow_parallel_tool_calls = allow_parallel_tool_calls
        self._tool_format = tool_call_format(tool_call_parser) if tool_call_parser else None
        reasoning = reasoning_format(reasoning_parser) if reasoning_parser else None
        self._actions = _marker_table(reasoning, self._tool_format)
        self._marker_sets = _marker_sets(reasoning, self._tool_format)
        self._schemas = ToolSchemas(tools)
        self._make_call_id = make_call_id
        self._mode = _Mode.REASONING if thinking and reasoning else _Mode.CONTENT
        self._unscanned = ""
        # Lists, not strings: a long argument or a whitespace loop arrives a token at a time,
        # and growing a string attribute piece by piece would copy it on every delta.
        self._call_parts: list[str] = []
        self._pending_space: list[str] = []
        self._is_segment_start = True
        self._is_finished = False
        self._reasoning_parts: list[str] = []
        self._content_parts: list[str] = []
        self._tool_calls: list[ToolCall] = []

    @property
    def has_tool_calls(self) -> bool:
        """Whether any tool call was released (the choice's finish_reason is then `tool_calls`)."""
        return bool(self._tool_calls)

    def feed(self, text_delta: str) -> MessageDelta:
        if self._is_finished:
            raise RuntimeError("feed() after finish()")
        delta = MessageDelta()
        self._unscanned += text_delta
        self._scan(delta, is_final=False)
        return delta

    def finish(self, *, model_stopped: bool = False) -> MessageDelta:
        """Flush at the end of the stream.

        `model_stopped`: the model ended the output (finish_reason "stop": its end-of-turn token,
        a stop token or a stop string), so a tool call still open, but not inside one of its
        arguments, is complete but for its closing tag and is released. Otherwise (`max_tokens`,
        an abort) an unfinished call is discarded.
        """
        delta = MessageDelta()
        if self._is_finished:
            return delta
        self._scan(delta, is_final=True)
        if model_stopped and self._mode is _Mode.IN_CALL:
            self._release_call(delta)
        self._call_parts = []
        self._pending_space = []
        self._mode = _Mode.ENDED
        self._is_finished = True
        return delta

    def message(self) -> AssistantMessage:
        """The message released so far; complete once `finish` has been called."""
        return AssistantMessage(
            reasoning_content="".join(self._reasoning_parts) or None,
            content="".join(self._content_parts) or None,
            tool_calls=list(self._tool_calls),
        )

    def _scan(self, delta: MessageDelta, *, is_final: bool) -> None:
        text, position = self._unscanned, 0
        self._unscanned = ""
        while position < len(text):
            match = self._marker_sets[self._mode].find(text, position)
            if match is None:
                self._take_text(text[position:], delta)
                return
            self._take_text(text[position : match.start], delta)
            if match.marker is None:
                # A possible marker at the very end: wait for more text, or drop it at the end
                # (a tag cut off by max_tokens is markup, not text).
                if not is_final:
                    self._unscanned = text[match.start :]
                return
            position = match.start + len(match.marker)
            self._apply(self._actions[self._mode][match.marker], match.marker, delta)

    def _take_text(self, text: str, delta: MessageDelta) -> None:
        if not text:
            return
        if self._mode in (_Mode.IN_CALL, _Mode.IN_VALUE):
            self._call_parts.append(text)
        elif self._mode in (_Mode.REASONING, _Mode.CONTENT):
            self._emit_text(text, delta)

    def _emit_text(self, text: str, delta: MessageDelta) -> None:
        if self._is_segment_start:
            text = text.lstrip()
            if not text:
                return
            self._is_segment_start = False
        stripped = text.rstrip()
        if not stripped:
            self._pending_space.append(text)
            return
        body = "".join(self._pending_space) + stripped
        trailing = text[len(stripped) :]
        self._pending_space = [trailing] if trailing else []
        if self._mode is _Mode.REASONING:
            self._reasoning_parts.append(body)
            delta.reasoning_content = (delta.reasoning_content or "") + body
        else:
            self._content_parts.append(body)
            delta.content = (delta.content or "") + body

    def _apply(self, action: _Action, marker: str, delta: MessageDelta) -> None:
        if action is _Action.DROP:
            return
        if action in (_Action.STRAY, _Action.OPEN_REASONING) and self._content_parts:
            # Reasoning and markup slips come before the answer: an answer that talks about
            # the tags (how a tool call ends, what `<think>` does) keeps them.
            self._emit_text(marker, delta)
            return
        if action is _Action.STRAY:
            return
        self._pending_space = []
        self._is_segment_start = True
        if action is _Action.OPEN_REASONING:
            self._mode = _Mode.REASONING
            if self._reasoning_parts:
                # A second block: its text goes on the reasoning a paragraph below the first's,
                # once some comes (an empty block adds nothing).
                self._pending_space = [_REASONING_BLOCK_SEPARATOR]
        elif action is _Action.CLOSE_REASONING:
            self._mode = _Mode.CONTENT
        elif action is _Action.OPEN_BLOCK:
            self._mode = _Mode.BETWEEN_CALLS
        elif action in (_Action.OPEN_VALUE, _Action.CLOSE_VALUE):
            # Value tags stay in the call's text: the format's `parse_call` reads them.
            self._call_parts.append(marker)
            self._mode = _Mode.IN_VALUE if action is _Action.OPEN_VALUE else _Mode.IN_CALL
        elif action is _Action.OPEN_CALL:
            if self._mode in (_Mode.IN_CALL, _Mode.IN_VALUE):  # a restart: no closing tag came
                self._release_call(delta)
            self._mode = _Mode.IN_CALL
            self._call_parts = [marker]
        elif action is _Action.CLOSE_CALL:
            self._release_call(delta)
            self._mode = _Mode.BETWEEN_CALLS
        elif action is _Action.END_TURN:
            if self._mode is _Mode.IN_CALL:  # the model ended its turn before the closing tag
                self._release_call(delta)
            self._call_parts = []
            self._mode = _Mode.ENDED

    def _release_call(self, delta: MessageDelta) -> None:
        assert self._tool_format is not None  # a call is only reachable with a tool format
        parsed = self._tool_format.parse_call("".join(self._call_parts))
        self._call_parts = []
        if parsed is None or not self._allow_tool_calls:
            return
        if self._tool_calls and not self._allow_parallel_tool_calls:
            return
        if self._tool_format.drops_undeclared_tools and not self._schemas.declares(parsed.name):
            return
        arguments = arguments_json(self._schemas.type_arguments(parsed.name, parsed.arguments))
        call = ToolCall(id=self._make_call_id(), name=parsed.name, arguments=arguments)
        index = len(self._tool_calls)
        self._tool_calls.append(call)
        delta.tool_calls.append(
            ToolCallDelta(index=index, id=call.id, type="function", name=call.name, arguments="")
        )
        delta.tool_calls.append(ToolCallDelta(index=index, arguments=call.arguments))


def parse_output(
    text: str,
    *,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = False,
    make_call_id: Callable[[], str] = new_call_id,
    allow_tool_calls: bool = True,
    allow_parallel_tool_calls: bool = True,
    model_stopped: bool = False,
) -> AssistantMessage:
    """The final message for a whole (non-streamed) output; `model_stopped` as in `finish`."""
    parser = ChatOutputParser(
        tool_call_parser,
        reasoning_parser,
        tools,
        thinking,
        make_call_id,
        allow_tool_calls,
        allow_parallel_tool_calls,
    )
    parser.feed(text)
    parser.finish(model_stopped=model_stopped)
    return parser.message()
