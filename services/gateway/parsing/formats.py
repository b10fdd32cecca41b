"""What the output parser needs to know about one markup format.

A reasoning format names the tags around the reasoning block; a tool-call format names the
tags that open and close a call (and, for DeepSeek-V4, the block around all calls) and parses one
complete call. Both list the turn terminators: special tokens after which nothing belongs to
this assistant turn (they reach the parser only when the detokenizer keeps special tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.parsing.argument_typing import RawArgument


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A tool call read from its markup, values still untyped."""

    name: str
    arguments: tuple[RawArgument, ...]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    terminators: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """Markers of one tool-call dialect and the parser of one complete call.

    `parse_call` receives the call's text from its opening marker up to (not including) the
    closing marker and returns None when the text is not a usable call. `call_restarts` are
    opening markers that, met inside a call, end it and begin the next (the model left the
    closing tag out). `drops_undeclared_tools`: a call to a tool the request did not declare is
    dropped instead of released (vLLM's choice for GLM). `value_starts` and `value_ends` open and
    close one argument inside a call (its name and value): an output that ends inside one was cut
    off mid-argument, one that ends between them may lack only the call's closing tag. Inside an
    open value the closing tags in `call_ends_outside_values` are the value's own text (a file the
    model writes may quote them), while the other `call_ends` still end the call.
    `starts_ending_reasoning` are the opening markers that, met inside the reasoning, end it and
    begin the calls: the wrapper the template writes around calls. Any other tool-call markup
    there is the reasoning's own text (the model planning a call, or thinking about the format),
    as vLLM's grammars read it.
    """

    name: str
    call_starts: tuple[str, ...]
    call_ends: tuple[str, ...]
    parse_call: Callable[[str], ParsedCall | None]
    block_starts: tuple[str, ...] = ()
    block_ends: tuple[str, ...] = ()
    terminators: tuple[str, ...] = ()
    call_restarts: tuple[str, ...] = ()
    drops_undeclared_tools: bool = False
    value_starts: tuple[str, ...] = ()
    value_ends: tuple[str, ...] = ()
    call_ends_outside_values: tuple[str, ...] = ()
    starts_ending_reasoning: tuple[str, ...] = ()

    @property
    def stray_markup(self) -> tuple[str, ...]:
        """Closing tags that can appear outside a call and must never reach the client."""
        return (*self.call_ends, *self.block_ends)
