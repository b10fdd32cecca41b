"""Property tests: any split of the output into deltas gives the same message, markup never
leaks, and output cut off anywhere yields no half-formed call and no exception."""

from __future__ import annotations

import dataclasses
import json
import string
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.parsing import AssistantMessage, parse_output
from tests.parsing.model_outputs import (
    FAMILIES,
    PROMPT_OPENED_STYLES,
    REASONING_PARSER_OF,
    REASONING_STYLES,
    THINK_STYLES,
    ExpectedCall,
    ExpectedMessage,
    all_markup,
    render_output,
    tools_for,
)
from tests.parsing.streaming_harness import (
    assert_openai_delta_shape,
    sequential_ids,
    split_at,
    stream,
)

MARKUP = all_markup()
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# Text full of the characters markup is made of, so near-misses of every tag get generated.
_TEXT_ALPHABET = (
    string.ascii_letters[:12] + string.digits[:4] + " \n\t<>/=\"'{}[],:|_-\\" + "é中\uff5c"
)
_text = st.text(alphabet=_TEXT_ALPHABET, max_size=40)


def _is_clean_text(text: str) -> bool:
    """No tag inside and no tag prefix at the end (a cut-off tag there is dropped by design)."""
    if any(tag in text for tag in MARKUP):
        return False
    return not any(tag.startswith(text[start:]) for start in range(len(text)) for tag in MARKUP)


_clean_text = _text.map(str.strip).filter(_is_clean_text)
_string_values = _text.filter(_is_clean_text)
_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    _string_values,
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=5), inner, max_size=3),
    ),
    max_leaves=6,
)
# Strings dominate real tool arguments (paths, code, queries), so they get half the draws.
_argument_values = st.one_of(_string_values, _json_values)
_argument_names = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=8)


@st.composite
def _messages(draw: st.DrawFn) -> ExpectedMessage:
    num_calls = draw(st.integers(min_value=0, max_value=3))
    calls = tuple(
        ExpectedCall(
            name=f"{draw(st.sampled_from(['get_weather', 'write_file', 'search']))}_{index}",
            arguments=draw(st.dictionaries(_argument_names, _argument_values, max_size=4)),
        )
        for index in range(num_calls)
    )
    return ExpectedMessage(
        reasoning=draw(st.one_of(st.none(), _clean_text)) or None,
        content=draw(st.one_of(st.none(), _clean_text)) or None,
        calls=calls,
    )


def _options(family: str, tools: list[dict[str, Any]], think_style: str) -> dict[str, Any]:
    return {
        "tool_call_parser": family,
        "reasoning_parser": REASONING_PARSER_OF[family],
        "tools": tools,
        "thinking": think_style in PROMPT_OPENED_STYLES,
    }


def _fit_to_style(expected: ExpectedMessage, think_style: str) -> ExpectedMessage:
    """Chat mode has no reasoning to expect."""
    return (
        expected
        if think_style in REASONING_STYLES
        else dataclasses.replace(expected, reasoning=None)
    )


def _assert_no_markup(message: AssistantMessage) -> None:
    for text in (message.content or "", message.reasoning_content or ""):
        assert not any(tag in text for tag in MARKUP), text


def _as_expected(message: AssistantMessage) -> ExpectedMessage:
    return ExpectedMessage(
        reasoning=message.reasoning_content,
        content=message.content,
        calls=tuple(
            ExpectedCall(call.name, json.loads(call.arguments)) for call in message.tool_calls
        ),
    )


@PROPERTY_SETTINGS
@given(
    family=st.sampled_from(FAMILIES),
    expected=_messages(),
    think_style=st.sampled_from(THINK_STYLES),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_any_split_gives_the_rendered_message(
    family: str, expected: ExpectedMessage, think_style: str, cuts: list[int]
) -> None:
    expected = _fit_to_style(expected, think_style)
    text = render_output(family, expected, think_style=think_style)
    tools = tools_for(expected.calls)

    whole = parse_output(
        text, make_call_id=sequential_ids(), **_options(family, tools, think_style)
    )
    assert _as_expected(whole) == expected
    for pieces in (split_at(text, cuts), list(text), [text]):
        deltas, streamed = stream(pieces, **_options(family, tools, think_style))
        assert streamed == whole
        assert_openai_delta_shape(deltas)


# An output cut after `cut` characters, streamed in pieces cut at `cuts`.
_OUTPUTS_CUT_ANYWHERE = given(
    family=st.sampled_from(FAMILIES),
    expected=_messages(),
    think_style=st.sampled_from(THINK_STYLES),
    cut=st.integers(min_value=0, max_value=2000),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8),
)


@PROPERTY_SETTINGS
@_OUTPUTS_CUT_ANYWHERE
def test_output_cut_anywhere_gives_a_prefix_and_only_whole_calls(
    family: str, expected: ExpectedMessage, think_style: str, cut: int, cuts: list[int]
) -> None:
    expected = _fit_to_style(expected, think_style)
    got = _as_expected(_parsed_cut(family, expected, think_style, cut, cuts, model_stopped=False))
    assert (expected.reasoning or "").startswith(got.reasoning or "")
    assert (expected.content or "").startswith(got.content or "")
    assert got.calls == expected.calls[: len(got.calls)]


def _parsed_cut(family: str, expected: ExpectedMessage, think_style: str, cut: int,
                cuts: list[int], *, model_stopped: bool) -> AssistantMessage:
    """The message of the output cut after `cut` characters, parsed whole and streamed in
    pieces cut at `cuts`; both ways must agree, in OpenAI's delta shape, with no markup."""
    text = render_output(family, expected, think_style=think_style)[:cut]
    options = _options(family, tools_for(expected.calls), think_style)
    whole = parse_output(text, make_call_id=sequential_ids(), model_stopped=model_stopped,
                         **options)
    deltas, streamed = stream(split_at(text, cuts), model_stopped=model_stopped, **options)
    assert streamed == whole
    assert_openai_delta_shape(deltas)
    _assert_no_markup(whole)
    return whole


def _is_argument_prefix(got: ExpectedCall, expected: ExpectedCall) -> bool:
    """`got` is `expected` but, possibly, for its last arguments."""
    written = list(expected.arguments.items())[: len(got.arguments)]
    return got.name == expected.name and list(got.arguments.items()) == written


@PROPERTY_SETTINGS
@_OUTPUTS_CUT_ANYWHERE
def test_output_the_model_stopped_anywhere_gives_whole_calls_and_a_last_one_between_arguments(
    family: str, expected: ExpectedMessage, think_style: str, cut: int, cuts: list[int]
) -> None:
    # A stop string can end the output anywhere. A call it ends between two arguments is sent
    # with the arguments written so far; one it ends inside an argument is not.
    expected = _fit_to_style(expected, think_style)
    got = _as_expected(_parsed_cut(family, expected, think_style, cut, cuts,
                                   model_stopped=True)).calls
    if got:
        assert got[:-1] == expected.calls[: len(got) - 1]
        assert _is_argument_prefix(got[-1], expected.calls[len(got) - 1])


_markup_soup = st.lists(
    st.one_of(
        st.sampled_from(sorted(MARKUP)), _text, st.sampled_from(['name="f">', "f>", "x</", "\n"])
    ),
    max_size=25,
).map("".join)


@settings(max_examples=150, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    text=_markup_soup,
    think_style=st.sampled_from(THINK_STYLES),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
)
def test_arbitrary_markup_soup_never_raises_and_is_split_invariant(
    family: str, text: str, think_style: str, cuts: list[int]
) -> None:
    schema = {"properties": {"n": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    whole = parse_output(
        text, make_call_id=sequential_ids(), **_options(family, tools, think_style)
    )
    for pieces in (split_at(text, cuts), list(text)):
        deltas, streamed = stream(pieces, **_options(family, tools, think_style))
        assert streamed == whole
        assert_openai_delta_shape(deltas)
