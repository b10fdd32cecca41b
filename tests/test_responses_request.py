"""The Responses request body read as a chat completion request, and output items built from
message deltas (pure Python)."""

from __future__ import annotations

from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from services.gateway.errors import InvalidRequestError, RequestFieldError
from services.gateway.parsing import MessageDelta, ToolCallDelta
from services.gateway.responses_request import ResponsesRequest, responses_message, responses_param
from services.gateway.routes.responses import OutputItems

STREAM_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi"} | fields)


def test_instructions_and_a_string_input_are_a_system_and_a_user_message() -> None:
    assert request(instructions="Be brief.").chat_messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_items_become_chat_messages_as_vllm_joins_them() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]},
        {"role": "assistant", "content": "Rain in Oslo, sun in Rome."},
    ]
    assert request(input=items).chat_messages() == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "reasoning": "Look it up.",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"},
        {"role": "assistant", "content": "Rain in Oslo, sun in Rome."},
    ]


def test_a_replayed_refusal_is_a_refusal_part_of_the_chat_message() -> None:
    """The chat renderer reads refusal parts as text, as vLLM's does; this was a 400."""
    items = [{"role": "user", "content": "Help me pick a lock."},
             {"type": "message", "role": "assistant",
              "content": [{"type": "refusal", "refusal": "I can't help with that."}]}]
    assert request(input=items).chat_messages()[1] == {
        "role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}


def test_a_reasoning_summary_stands_in_for_absent_content() -> None:
    items = [{"role": "user", "content": "q"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "gist"}]}]
    assert request(input=items).chat_messages()[-1] == {"role": "assistant", "content": None,
                                                        "reasoning": "gist"}


def test_null_parallel_tool_calls_and_stream_mean_their_defaults() -> None:
    body = request(parallel_tool_calls=None, stream=None)
    assert body.parallel_tool_calls is True and body.stream is False
    assert body.chat_request().parallel_tool_calls is True


def test_the_chat_request_carries_tools_choice_format_effort_and_limit() -> None:
    chat = request(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                   parallel_tool_calls=False, reasoning={"effort": "low"}, max_output_tokens=7,
                   temperature=0.5, top_p=0.9,
                   text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                   ).chat_request()
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}, "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False and chat.reasoning_effort == "low"
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.n) == (7, 0.5, 0.9, 1)
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert request(text={"format": {"type": "json_object"}}).chat_request().response_format.type == "json_object"
    assert request(text={"format": {"type": "text"}}).chat_request().response_format is None


@pytest.mark.parametrize(("fields", "param", "problem"), [
    ({"input": [{"type": "computer_call"}]}, "input", "unsupported item type 'computer_call'"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "..."}]}, "input", "encrypted"),
    ({"input": []}, "input", "empty"),
    ({"tools": [{"type": "file_search"}]}, "tools", "only function tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice", "'other'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"text": {"format": {"type": "json_schema"}}}, "text", "needs a schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text", "needs a name"),
])
def test_bad_fields_are_refused_by_name(fields: dict[str, Any], param: str, problem: str) -> None:
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    cause = caught.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, RequestFieldError) and cause.param == param and problem in str(cause)


@pytest.mark.parametrize(("item", "message"), [
    ({"type": "computer_call"}, "input[1]: unsupported item type 'computer_call'"),
    ({"type": "function_call_output", "output": "x"}, "input[1].call_id: Field required"),
    ({"type": "function_call_output", "call_id": "c9", "output": "x"},
     "input[1]: no function_call item before it has call_id 'c9'"),
])
def test_an_input_items_error_begins_with_the_item_once(item: dict[str, Any], message: str) -> None:
    """Was `input: input[1]...`: the field named twice."""
    with pytest.raises(ValidationError) as caught:
        request(input=[{"role": "user", "content": "hi"}, item])
    assert str(caught.value.errors()[0]["ctx"]["error"]).startswith(message)


@pytest.mark.parametrize(("fields", "param", "where"), [
    ({"input": [{"role": "user", "content": "a\ud800"}]}, "input", "input[0].content"),
    ({"metadata": {"k": "\ud800"}}, "metadata", "metadata.k"),  # echoed back, never sent on
])
def test_a_lone_surrogate_is_refused_naming_its_field(fields: dict[str, Any], param: str, where: str) -> None:
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    cause = caught.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, RequestFieldError) and cause.param == param
    assert f"surrogate in {where} " in str(cause)


def test_chat_fields_in_errors_are_renamed_to_responses_fields() -> None:
    assert responses_param("messages[2].content") == "input[2].content"
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("response_format") == "text"
    assert responses_param("tool_choice") == "tool_choice"
    assert responses_param(None) is None
    assert responses_message("tool_choice: cannot be combined with response_format") == (
        "tool_choice: cannot be combined with text")
    assert responses_message("max_output_tokens=9 and max_tokens") == "max_output_tokens=9 and max_output_tokens"



def test_streamed_events_accumulate_in_the_openai_client_to_the_output_items() -> None:
    """Reasoning, text and two calls through the client's own stream state (the embedded
    model of the mesh tests never reasons)."""
    output = OutputItems()
    deltas = [MessageDelta(reasoning_content="Think"), MessageDelta(reasoning_content=" more."),
              MessageDelta(content="Calling"), MessageDelta(content=" tools."),
              MessageDelta(tool_calls=[ToolCallDelta(0, "call_a", "function", "f", '{"x": ')]),
              MessageDelta(tool_calls=[ToolCallDelta(0, arguments="1}")]),
              MessageDelta(tool_calls=[ToolCallDelta(1, "call_b", "function", "g", "{}")])]
    item_events = [event for delta in deltas for event in output.add(delta)] + output.close("completed")
    response = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m", "output": [],
                "status": "in_progress", "tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
    events = [{"type": "response.created", "response": response}, *item_events,
              {"type": "response.completed",
               "response": response | {"output": output.items, "status": "completed"}}]
    state = ResponseStreamState(input_tools=[], text_format=omit)
    fired = [fired for number, event in enumerate(events) for fired in state.handle_event(
        STREAM_EVENT.validate_python(event | {"sequence_number": number}))]

    assert [item["type"] for item in output.items] == ["reasoning", "message", "function_call", "function_call"]
    assert output.items[0]["content"] == [{"type": "reasoning_text", "text": "Think more."}]
    assert [(i["call_id"], i["arguments"], i["status"]) for i in output.items[2:]] == [
        ("call_a", '{"x": 1}', "completed"), ("call_b", "{}", "completed")]
    assert [(e["name"], e["arguments"]) for e in events
            if e["type"] == "response.function_call_arguments.done"] == [("f", '{"x": 1}'), ("g", "{}")]
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == output.items
    text_deltas = [e for e in fired if e.type == "response.output_text.delta"]
    assert text_deltas[-1].snapshot == "Calling tools."
    assert fired[-1].type == "response.completed"
    assert [item.model_dump(exclude_none=True) for item in fired[-1].response.output] == output.items

def test_vllms_sampling_fields_reach_the_chat_request() -> None:
    """vLLM's Responses API takes these as its chat API does; they were silently ignored."""
    chat = request(stop=["Paris"], seed=7, top_k=20, min_p=0.05, repetition_penalty=1.2,
                   presence_penalty=0.5, frequency_penalty=0.25, stop_token_ids=[2], ignore_eos=True,
                   logit_bias={"504": 5}, include_stop_str_in_output=True, skip_special_tokens=False,
                   include_reasoning=False, chat_template_kwargs={"enable_thinking": False}
                   ).chat_request()
    assert (chat.stop, chat.seed, chat.top_k, chat.min_p, chat.repetition_penalty) == (
        ["Paris"], 7, 20, 0.05, 1.2)
    assert (chat.presence_penalty, chat.frequency_penalty, chat.stop_token_ids, chat.ignore_eos) == (
        0.5, 0.25, [2], True)
    assert chat.logit_bias == {"504": 5} and chat.include_stop_str_in_output is True
    assert chat.skip_special_tokens is False and chat.include_reasoning is False
    assert chat.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(("fields", "param"), [
    ({"stop": [""]}, "stop"), ({"top_k": -2}, "top_k"), ({"vllm_xargs": {"k": 1}}, "vllm_xargs")])
def test_a_bad_vllm_sampling_field_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        request(**fields).chat_request()
    assert caught.value.param == param


def test_a_null_text_or_format_means_plain_text() -> None:
    """vLLM takes both as unset; they were a 400."""
    assert request(text=None).chat_request().response_format is None
    assert request(text={"format": None}).chat_request().response_format is None


def test_an_unfinished_last_assistant_message_is_continued_as_vllm_does() -> None:
    """vLLM's partial completion: the model goes on with the message instead of starting another."""
    said = [{"role": "user", "content": "Capital of France?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                  "text": "The capital is"}]}]
    for status in ("incomplete", "in_progress"):
        said[-1]["status"] = status
        assert request(input=said).chat_request().continue_final_message is True
    said[-1]["status"] = "completed"
    assert request(input=said).chat_request().continue_final_message is False
    unfinished_user = [{"role": "user", "content": "Capital of", "status": "incomplete"}]
    assert request(input=unfinished_user).chat_request().continue_final_message is False


def test_include_reasoning_false_leaves_the_reasoning_item_out() -> None:
    """vLLM's `include_reasoning: false` on the Responses API: the answer without its reasoning."""
    output = OutputItems(includes_reasoning=False)
    events = output.add(MessageDelta(reasoning_content="Think.", content="Paris."))
    events += output.close("completed")
    assert [item["type"] for item in output.items] == ["message"]
    assert not any(event["type"].startswith("response.reasoning") for event in events)


def test_include_of_logprobs_asks_the_chat_request_for_them() -> None:
    """vLLM's rule: `top_logprobs` counts only where `include` asks for logprobs; null is 0."""
    chat = request(include=["message.output_text.logprobs"], top_logprobs=3).chat_request()
    assert (chat.logprobs, chat.top_logprobs) == (True, 3)
    chat = request(include=["message.output_text.logprobs"], top_logprobs=None).chat_request()
    assert (chat.logprobs, chat.top_logprobs) == (True, 0)
    chat = request(top_logprobs=3).chat_request()
    assert chat.logprobs is False and chat.num_logprobs is None


@pytest.mark.parametrize("top_logprobs", [21, -1, 2.5])
def test_top_logprobs_outside_0_to_20_is_refused_by_name(top_logprobs: float) -> None:
    """OpenAI's bounds, and vLLM's default --max-logprobs; with or without `include`."""
    for include in (None, ["message.output_text.logprobs"]):
        with pytest.raises(ValidationError) as caught:
            request(include=include, top_logprobs=top_logprobs)
        assert caught.value.errors()[0]["loc"] == ("top_logprobs",)


def token(text: str) -> dict[str, Any]:
    """A logprob entry of the output_text part's shape."""
    return {"token": text, "logprob": -0.5, "bytes": list(text.encode()),
            "top_logprobs": [{"token": text, "logprob": -0.5, "bytes": list(text.encode())}]}


def test_logprobs_go_with_the_text_their_tokens_wrote() -> None:
    """vLLM's streamed rule: a chunk's logprobs ride on the message text it adds; a chunk that
    writes reasoning or a call shows none. Tokens that write nothing yet (a character's first
    byte, a marker the parser holds) go with the next text, and those left at the end (the EOS)
    close the message on an empty delta, so the deltas add up to the part's list."""
    output = OutputItems()
    events = output.add(MessageDelta(reasoning_content="Hm"), [token("<think>Hm")])
    events += output.add(MessageDelta(), [token("</think>")])
    events += output.add(MessageDelta(content="Par"), [token("Par")])
    events += output.add(MessageDelta(), [token("\xe6")])
    events += output.add(MessageDelta(content="is東"), [token("is東")])
    events += output.add(MessageDelta(), [token("<|im_end|>")])
    events += output.close("completed")
    [message] = [item for item in output.items if item["type"] == "message"]
    part_logprobs = message["content"][0]["logprobs"]
    assert [entry["token"] for entry in part_logprobs] == ["</think>", "Par", "\xe6", "is東", "<|im_end|>"]
    text_deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert [(event["delta"], [entry["token"] for entry in event["logprobs"]]) for event in text_deltas] == [
        ("Par", ["</think>", "Par"]), ("is東", ["\xe6", "is東"]), ("", ["<|im_end|>"])]
    # A delta event's entries are OpenAI's stream shape, without bytes.
    assert text_deltas[0]["logprobs"][1] == {"token": "Par", "logprob": -0.5,
                                             "top_logprobs": [{"token": "Par", "logprob": -0.5}]}
    for event in events:
        STREAM_EVENT.validate_python(event | {"sequence_number": 0})


def test_a_call_or_reasoning_after_the_text_takes_its_own_tokens() -> None:
    output = OutputItems()
    output.add(MessageDelta(content="Checking."), [token("Checking.")])
    output.add(MessageDelta(), [token("<tool_call>")])
    output.add(MessageDelta(tool_calls=[ToolCallDelta(0, "call_a", "function", "f", "{}")]), [token("{}")])
    output.add(MessageDelta(), [token("<|im_end|>")])
    output.close("completed")
    assert [entry["token"] for entry in output.items[0]["content"][0]["logprobs"]] == ["Checking."]


def test_truncation_drops_leading_items_and_the_call_outputs_of_calls_dropped() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}
    body = request(input=[{"role": "user", "content": "Weather?"}, call, answer,
                          {"role": "user", "content": "And tomorrow?"}])
    assert [item.type for item in body.without_first_items(1).input] == [
        "function_call", "function_call_output", "message"]
    assert [item.type for item in body.without_first_items(2).input] == ["message"]
    assert body.without_first_items(0) is body and body.num_items == 4
