"""DeepSeek-V4's own prompt encoding (the checkpoint ships no jinja template).

Layout: BOS, the effort preamble (thinking mode only), then the turns. A system turn carries the
request's tools as a `## Tools` section; a user turn is `<｜User｜>` plus its text and the
`<tool_result>` blocks of the tool messages around it; each assistant turn is reasoning and
`</think>` (when kept), content, a DSML tool-call block, EOS. A non-assistant turn that is last
or followed by an assistant opens the next answer with `<｜Assistant｜>` and `<think>` (thinking)
or `</think>` (chat). Reasoning of turns before the last user turn is dropped unless the
request has tools, where the model was trained to see its earlier reasoning.

Template kwargs are read the way vLLM reads them for this model: `thinking` / `enable_thinking`
(thinking is on when neither is given), `reasoning_effort` (`none` forces chat mode;
low/minimal/medium -> low; max -> max; anything else -> high) and `drop_thinking`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.tokenizer.chat_formats.openai_messages import ChatMessage, ToolCall, parse_messages, parse_tools
from services.tokenizer.chat_formats.protocol import ChatRenderError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"

ReasoningEffort = Literal["low", "high", "max"]
# The roles this encoding writes; vLLM's encoder refuses the others ("Invalid role").
ENCODED_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")

# The model was trained on these exact texts; "low" adds nothing.
EFFORT_PREAMBLES: dict[ReasoningEffort, str] = {
    "low": "",
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve"
        " the root cause, rigorously stress-testing your logic against all potential paths, edge cases,"
        " and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step,"
        " considered alternative, and rejected hypothesis to ensure absolutely no assumption is left"
        " unchecked.\n\n"
    ),
    "max": (
        "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance:"
        " exhaustively decompose the problem into its most fundamental components, trace every causal"
        " chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple angles"
        " and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
    ),
}

_TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_OPEN}), you MUST output your complete reasoning inside {THINK_OPEN}...{THINK_CLOSE} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_CLOSE} with tool calls or final response.

### Available Tool Schemas

{{tool_schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


@dataclass(frozen=True, slots=True)
class DeepseekV4Mode:
    """How one request is encoded: thinking or chat, the effort, and whether old reasoning goes."""

    is_thinking: bool
    reasoning_effort: ReasoningEffort
    drop_earlier_reasoning: bool = True

    @classmethod
    def from_template_kwargs(cls, template_kwargs: Mapping[str, Any]) -> DeepseekV4Mode:
        """Reads `thinking`, `enable_thinking`, `reasoning_effort` and `drop_thinking`."""
        if "thinking" in template_kwargs or "enable_thinking" in template_kwargs:
            is_thinking = bool(template_kwargs.get("thinking")) or bool(template_kwargs.get("enable_thinking"))
        else:
            is_thinking = True
        effort = template_kwargs.get("reasoning_effort")
        if effort == "none":
            is_thinking = False
        return cls(is_thinking=is_thinking, reasoning_effort=normalized_effort(effort),
                   drop_earlier_reasoning=bool(template_kwargs.get("drop_thinking", True)))


def normalized_effort(effort: object) -> ReasoningEffort:
    """Maps an OpenAI `reasoning_effort` onto the three levels the model knows (unset -> high)."""
    if effort == "max":
        return "max"
    if effort in ("low", "minimal", "medium"):
        return "low"
    return "high"


@dataclass(frozen=True, slots=True)
class _ToolResult:
    call_id: str
    content: str


@dataclass(slots=True)
class _Turn:
    """One encoded turn; runs of user and tool messages become a single user turn."""

    role: Literal["system", "developer", "user", "assistant"]
    text: str = ""
    # User turns: user texts and tool results, in prompt order.
    blocks: list[str | _ToolResult] = field(default_factory=list)
    message: ChatMessage | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)


class DeepseekV4Renderer:
    """Renders OpenAI chat requests in DeepSeek-V4's encoding."""

    name = "deepseek_v4"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """Renders the prompt; see the module docstring for the layout."""
        parsed = parse_messages(messages)
        tool_functions = [tool["function"] for tool in parse_tools(tools)]
        if add_generation_prompt and continue_final_message:
            raise ChatRenderError("continue_final_message", "cannot be combined with add_generation_prompt")
        if continue_final_message and parsed[-1].role != "assistant":
            raise ChatRenderError(f"messages[{len(parsed) - 1}].role",
                                  "continue_final_message needs a final assistant message")
        for index, message in enumerate(parsed):
            if message.role not in ENCODED_ROLES:
                raise ChatRenderError(f"messages[{index}].role",
                                      f"DeepSeek-V4's encoding has no role {message.role!r}; "
                                      f"expected one of {', '.join(ENCODED_ROLES)}")
            # The model never saw an empty developer turn (vLLM's encoder refuses one too).
            if message.role == "developer" and not "".join(message.text_parts):
                raise ChatRenderError(f"messages[{index}].content", "must not be empty for a developer message")
        mode = DeepseekV4Mode.from_template_kwargs(template_kwargs)
        return encode(parsed, tool_functions, mode, add_generation_prompt, continue_final_message)


def encode(
    messages: list[ChatMessage],
    tool_functions: list[dict[str, Any]],
    mode: DeepseekV4Mode,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Encodes validated messages; `tool_functions` are the `function` objects of the tools."""
    turns = _turns_with_tools(_merge_user_and_tool_messages(messages), tool_functions)
    _order_tool_results_by_call(turns)
    # With tools in play the model must see why it made earlier calls, so nothing is dropped.
    drop_earlier = mode.drop_earlier_reasoning and not tool_functions
    if mode.is_thinking and drop_earlier:
        turns = _without_earlier_developer_turns(turns)
    last_user_index = max((i for i, turn in enumerate(turns) if turn.role in ("user", "developer")), default=-1)

    pieces = [BOS]
    if mode.is_thinking:
        pieces.append(EFFORT_PREAMBLES[mode.reasoning_effort])
    for index, turn in enumerate(turns):
        is_final = index == len(turns) - 1
        keeps_reasoning = mode.is_thinking and (not drop_earlier or index > last_user_index)
        pieces.append(_encode_turn(turn, keeps_reasoning, is_continued=is_final and continue_final_message))
        next_role = None if is_final else turns[index + 1].role
        opens_answer = turn.role != "assistant" and next_role in (None, "assistant")
        if opens_answer and (add_generation_prompt or not is_final):
            opens_thinking = mode.is_thinking and (not drop_earlier or index >= last_user_index)
            pieces.append(ASSISTANT + (THINK_OPEN if opens_thinking else THINK_CLOSE))
    return "".join(pieces)


def _merge_user_and_tool_messages(messages: list[ChatMessage]) -> list[_Turn]:
    # DeepSeek-V4 has no tool role: results travel inside the user turn that follows the call.
    turns: list[_Turn] = []
    for message in messages:
        if message.role in ("user", "tool"):
            if not turns or turns[-1].role != "user":
                turns.append(_Turn(role="user"))
            if message.role == "user":
                turns[-1].blocks.append("\n\n".join(message.text_parts))
            else:
                # vLLM joins a tool message's text parts with one newline, user parts with two.
                turns[-1].blocks.append(_ToolResult(message.tool_call_id or "", "\n".join(message.text_parts)))
        else:
            turns.append(_Turn(role=message.role, text="\n\n".join(message.text_parts), message=message))
    return turns


def _turns_with_tools(turns: list[_Turn], tool_functions: list[dict[str, Any]]) -> list[_Turn]:
    if not tool_functions:
        return turns
    system = next((turn for turn in turns if turn.role == "system"), None)
    if system is None:
        system = _Turn(role="system")
        turns = [system, *turns]
    system.tools = tool_functions
    return turns


def _order_tool_results_by_call(turns: list[_Turn]) -> None:
    # Parallel results may come back in any order; the model sees them in call order.
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.message is not None and turn.message.tool_calls:
            call_order = {call.call_id: i for i, call in enumerate(turn.message.tool_calls) if call.call_id}
        elif turn.role == "user" and call_order:
            results = [block for block in turn.blocks if isinstance(block, _ToolResult)]
            if len(results) < 2:
                continue
            ordered = iter(sorted(results, key=lambda result: call_order.get(result.call_id, 0)))
            turn.blocks = [next(ordered) if isinstance(block, _ToolResult) else block for block in turn.blocks]


def _without_earlier_developer_turns(turns: list[_Turn]) -> list[_Turn]:
    last_user_index = max((i for i, turn in enumerate(turns) if turn.role in ("user", "developer")), default=-1)
    return [turn for i, turn in enumerate(turns) if turn.role != "developer" or i >= last_user_index]


def _encode_turn(turn: _Turn, keeps_reasoning: bool, is_continued: bool) -> str:
    if turn.role == "system":
        if not turn.tools:
            return turn.text
        schemas = "\n".join(_to_json(function) for function in turn.tools)
        return turn.text + "\n\n" + _TOOLS_SECTION.replace("{tool_schemas}", schemas)
    if turn.role == "developer":
        return USER + turn.text
    if turn.role == "user":
        return USER + "\n\n".join(
            f"<tool_result>{block.content}</tool_result>" if isinstance(block, _ToolResult) else block
            for block in turn.blocks)
    assert turn.message is not None  # assistant turns always keep their message
    message = turn.message
    pieces = []
    if keeps_reasoning:
        pieces.append(message.reasoning or "")
        # A continued turn still inside its reasoning must stay open for the model to go on.
        if not (is_continued and not turn.text and not message.tool_calls):
            pieces.append(THINK_CLOSE)
    pieces.append(turn.text)
    if message.tool_calls:
        pieces.append("\n\n" + _encode_tool_calls(message.tool_calls))
    if not is_continued:
        pieces.append(EOS)
    return "".join(pieces)


def _encode_tool_calls(tool_calls: Sequence[ToolCall]) -> str:
    invokes = []
    for call in tool_calls:
        parameters = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else _to_json(value)}</{DSML}parameter>"
            for key, value in call.arguments.items())
        invokes.append(f'<{DSML}invoke name="{call.name}">\n{parameters}\n</{DSML}invoke>')
    return f"<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
