"""The tokenizer service as a real process over real gRPC: what a bad request gets back."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer, processors

from backport.v1 import tokenizer_pb2 as pb
from services.tokenizer.client import TokenizerClient
from tests.cluster.processes import kill_group, start_tokenizer
from tests.conftest import free_port, wait_for_grpc_serving

START_TIMEOUT_S = 120.0


# The embedded model's tokenizer with a template that prints tools and tool-call arguments as
# JSON, and an embedding table padded past its 49152 tokens, as many checkpoints' are.
TOOLS_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% endfor %}")
PADDED_VOCAB_SIZE = 49280


@pytest.fixture(scope="module")
def tokenizer_address(embedded_model_path: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serve_tokenizer(embedded_model_path, tmp_path_factory)


@pytest.fixture(scope="module")
def padded_tools_tokenizer_address(embedded_model_path: Path,
                                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tmp_path_factory.mktemp("padded-tools-model")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(embedded_model_path / name, model / name)
    config = json.loads((embedded_model_path / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"vocab_size": PADDED_VOCAB_SIZE}))
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    yield from serve_tokenizer(model, tmp_path_factory)


@pytest.fixture(scope="module")
def bos_tokenizer_address(embedded_model_path: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded model with a tokenizer that puts a BOS (id 0) before every text it encodes
    with special tokens, as Llama's and DeepSeek's do (SmolLM2's adds none)."""
    model = tmp_path_factory.mktemp("bos-model")
    for path in embedded_model_path.iterdir():
        if path.suffix in (".json", ".jinja") and path.name != "tokenizer.json":
            shutil.copy(path, model / path.name)
    tokenizer = Tokenizer.from_file(str(embedded_model_path / "tokenizer.json"))
    bos = tokenizer.id_to_token(0)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, 0)])
    tokenizer.save(str(model / "tokenizer.json"))
    yield from serve_tokenizer(model, tmp_path_factory)


def serve_tokenizer(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.log"
    process = start_tokenizer(model, port, log_path)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process, log_path)
        yield f"127.0.0.1:{port}"
    finally:
        kill_group(process)
        process.wait()


def render_error(address: str, template_kwargs: dict[str, object],
                 messages: list[dict[str, Any]] | None = None) -> grpc.aio.AioRpcError:
    async def render() -> grpc.aio.AioRpcError:
        client = TokenizerClient(address)
        try:
            await client.render_chat(messages or [{"role": "user", "content": "Hi"}], None,
                                     template_kwargs, add_generation_prompt=True,
                                     continue_final_message=False)
        except grpc.aio.AioRpcError as error:
            return error
        finally:
            await client.close()
        raise AssertionError("the render succeeded")

    return asyncio.run(render())


def call_error(call: Coroutine[Any, Any, object]) -> grpc.aio.AioRpcError:
    try:
        asyncio.run(call)
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the call succeeded")


def test_template_kwarg_of_the_wrong_type_is_invalid_argument(tokenizer_address: str) -> None:
    # `documents` reaches apply_chat_template, which iterates it: a number fails there with a
    # TypeError, the request's fault, which used to come back as UNKNOWN.
    error = render_error(tokenizer_address, {"documents": 5})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith("messages: the model's chat template failed on the request")
    assert "TypeError" in error.details()


def test_the_service_still_renders_after_a_rejected_request(tokenizer_address: str) -> None:
    render_error(tokenizer_address, {"documents": 5})

    async def render() -> list[int]:
        client = TokenizerClient(tokenizer_address)
        try:
            reply = await client.render_chat([{"role": "user", "content": "Hi"}], None, {},
                                             add_generation_prompt=True,
                                             continue_final_message=False)
            return list(reply.token_ids)
        finally:
            await client.close()

    assert len(asyncio.run(render())) > 3


def test_a_render_adds_the_tokenizers_special_tokens_only_when_asked(
        bos_tokenizer_address: str) -> None:
    """vLLM's chat `add_special_tokens`: off by default, since templates write their own."""
    async def render(add_special_tokens: bool) -> list[int]:
        client = TokenizerClient(bos_tokenizer_address)
        try:
            reply = await client.render_chat([{"role": "user", "content": "Hi"}], None, {},
                                             add_generation_prompt=True,
                                             continue_final_message=False,
                                             add_special_tokens=add_special_tokens)
            return list(reply.token_ids)
        finally:
            await client.close()

    plain = asyncio.run(render(False))
    assert plain[0] != 0 and asyncio.run(render(True)) == [0, *plain]


def test_tools_and_tool_call_arguments_render_as_the_client_wrote_them(
        padded_tools_tokenizer_address: str) -> None:
    """Keys in the client's order, integers as integers, as vLLM's server renders them. Sent
    as Structs, the keys came in no set order (`{"minimum": 1, "type": "integer"}`) and every
    number as a double (`"minimum": 1.0`, `{"days": 3.0}`)."""
    schema = {"type": "object", "required": ["days"],
              "properties": {"days": {"type": "integer", "minimum": 1}, "city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "forecast", "parameters": schema}}
    arguments = {"days": 3, "scale": 0.5, "city": "Oslo"}
    prompt = rendered_prompt(padded_tools_tokenizer_address, forecast_call(arguments), [tool])
    assert json.dumps(schema) in prompt, prompt
    assert json.dumps(arguments) in prompt, prompt


def forecast_call(arguments: str | dict[str, Any]) -> list[dict[str, Any]]:
    """A question and the assistant's call to `forecast` with `arguments`."""
    return [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "forecast", "arguments": arguments}}]}]


def rendered_prompt(address: str, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> str:
    async def render() -> str:
        client = TokenizerClient(address)
        try:
            reply = await client.render_chat(messages, tools, {}, add_generation_prompt=False,
                                             continue_final_message=False)
            return reply.prompt
        finally:
            await client.close()

    return asyncio.run(render())


@pytest.mark.parametrize(("arguments", "field", "says"), [
    # Parsed, the escape is a lone surrogate, which the template writes into the prompt.
    ('{"city": "Paris \\ud800"}', "messages", "lone surrogate"),
])
def test_tool_call_arguments_that_make_no_prompt_are_invalid_argument(
        padded_tools_tokenizer_address: str, arguments: str, field: str, says: str) -> None:
    """Was UNKNOWN (the gateway's 503, which clients retry): the tokenizer library's TypeError
    on the prompt's lone surrogate, raised past the render's own errors."""
    error = render_error(padded_tools_tokenizer_address, {}, forecast_call(arguments))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(f"{field}: ") and says in error.details(), error.details()


def test_tool_call_arguments_nested_past_the_stack_render_as_no_arguments(
        padded_tools_tokenizer_address: str) -> None:
    """Was UNKNOWN: json.loads raised RecursionError on 1,200 nested lists. Arguments that are
    no JSON object render as {} (one bad call in a history must not make it unrenderable)."""
    nested = '{"a": ' + "[" * 1200 + "]" * 1200 + "}"
    assert "<call>{}</call>" in rendered_prompt(padded_tools_tokenizer_address, forecast_call(nested))


@pytest.mark.parametrize(("template_kwargs", "messages", "field"), [
    ({"budget": float("inf")}, None, "chat_template_kwargs.budget"),
    ({}, [{"role": "user", "content": "Hi", "weights": [1, float("nan")]}], "messages[0].weights[1]"),
])
def test_a_number_json_cannot_hold_is_invalid_argument_naming_it(
        tokenizer_address: str, template_kwargs: dict[str, object],
        messages: list[dict[str, Any]] | None, field: str) -> None:
    # Was UNKNOWN: "Unexpected <class 'ValueError'>: Fail to serialize Infinity for Value.number_value".
    error = render_error(tokenizer_address, template_kwargs, messages)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(f"{field}: "), error.details()


OUTSIDE_VOCABULARY = f"lies outside the vocabulary (the model's token ids are 0 to {PADDED_VOCAB_SIZE - 1})"


async def detokenize(address: str, token_ids: list[int]) -> None:
    """A stream's first step, then one with `token_ids`."""
    client = TokenizerClient(address)
    try:
        call = client.stub.Detokenize()
        await call.write(pb.DetokenizeRequest(token_ids=[504]))
        await call.read()
        await call.write(pb.DetokenizeRequest(token_ids=token_ids))
        await call.read()
    finally:
        await client.close()


@pytest.mark.parametrize(("call", "field"), [
    (lambda c, ids: c.stub.Decode(pb.DecodeRequest(token_ids=ids)), "token_ids"),
    (lambda c, ids: c.stub.DecodeTokens(pb.DecodeTokensRequest(token_ids=ids)), "token_ids"),
    (lambda c, ids: c.stub.DecodeTokensInContext(pb.DecodeTokensInContextRequest(
        tokens=[pb.TokenInContext(token_id=504), pb.TokenInContext(token_id=ids[-1])])),
     "tokens[1].token_id"),
    (lambda c, ids: c.stub.DecodeTokensInContext(pb.DecodeTokensInContextRequest(
        tokens=[pb.TokenInContext(token_id=504, context_token_ids=ids)])),
     "tokens[0].context_token_ids"),
])
def test_a_token_id_past_the_vocabulary_is_invalid_argument_naming_the_field(
        padded_tools_tokenizer_address: str,
        call: Callable[[TokenizerClient, list[int]], Awaitable[object]], field: str) -> None:
    # Ids past the tokenizer's tokens but inside the model's padded embedding table are ids the
    # engine takes: they decode to "", as vLLM shows them. Past the table the tokenizers library
    # decoded them to "" too, and a caller's mistake (a negative int32 sent as uint32) went unseen.
    async def run(token_ids: list[int]) -> object:
        client = TokenizerClient(padded_tools_tokenizer_address)
        try:
            return await call(client, token_ids)
        finally:
            await client.close()

    asyncio.run(run([504, PADDED_VOCAB_SIZE - 1]))
    error = call_error(run([504, 2**32 - 1]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details() == f"{field}: token id {2**32 - 1} {OUTSIDE_VOCABULARY}"


def test_a_detokenize_step_past_the_vocabulary_ends_the_stream_invalid_argument(
        padded_tools_tokenizer_address: str) -> None:
    error = call_error(detokenize(padded_tools_tokenizer_address, [504, PADDED_VOCAB_SIZE]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details() == f"token_ids: token id {PADDED_VOCAB_SIZE} {OUTSIDE_VOCABULARY}"



LONG_TOKEN_IDS = [1_000 + i % 40_000 for i in range(2_000_000)]
LONG_TEXT = " ".join(f"word{i} of a long prompt" for i in range(60_000))


async def decode_long(client: TokenizerClient) -> int:
    return len(await client.decode(LONG_TOKEN_IDS, skip_special_tokens=True))


async def encode_long(client: TokenizerClient) -> int:
    return len(await client.encode(LONG_TEXT, add_special_tokens=False))


@pytest.mark.parametrize("long_call", [decode_long, encode_long])
def test_a_long_call_leaves_other_streams_answered(
        tokenizer_address: str, long_call: Callable[[TokenizerClient], Awaitable[int]]) -> None:
    # Each long call takes the service over half a second. The tokenizers library held the GIL
    # through it, on the event loop or on a worker thread alike, and so held every other call
    # that long: a streaming request's detokenize steps too.
    async def count_steps_during_a_long_call() -> int:
        client = TokenizerClient(tokenizer_address)
        stream = client.detokenizer(skip_special_tokens=True, prompt_token_ids=[])
        try:
            await stream.step([1_000])
            long_call_done = asyncio.ensure_future(long_call(client))
            # Past the time the service takes to receive and parse the request.
            await asyncio.sleep(0.2)
            num_steps = 0
            while not long_call_done.done():
                await stream.step([1_000])
                num_steps += 1
            assert await long_call_done > 100_000
            return num_steps
        finally:
            stream.close()
            await client.close()

    # A step takes about a millisecond; one held behind the long call would end it.
    assert asyncio.run(count_steps_during_a_long_call()) >= 10


def test_logprob_texts_of_characters_split_across_tokens_join_up_to_the_text(
        tokenizer_address: str) -> None:
    # Byte-level tokens each holding part of a character decode alone to U+FFFD; in context,
    # the token completing a character shows all of it and the ones before it nothing.
    text = "東京は日本の首都です"

    async def texts() -> tuple[list[str], list[list[str]]]:
        client = TokenizerClient(tokenizer_address)
        try:
            ids = await client.encode(text, add_special_tokens=False)
            positions = [(ids[max(0, k - 4):k], [token_id]) for k, token_id in enumerate(ids)]
            return await client.token_texts(ids), await client.logprob_token_texts(positions)
        finally:
            await client.close()

    alone, in_context = asyncio.run(texts())
    assert sum(t.endswith("\ufffd") for t in alone) > len(text) / 2
    assert "".join(candidates[0] for candidates in in_context) == text
    assert all(not t.endswith("\ufffd") for [t] in in_context)


def test_sigterm_with_a_detokenize_stream_open_ends_it_after_the_drain_without_a_traceback(
        embedded_model_path: Path, tmp_path: Path) -> None:
    """The stream is served through the drain, then cancelled; grpc had logged that as an
    ERROR traceback when the loop's teardown, not the drain, ended the call."""
    port, log_path = free_port(), tmp_path / "tokenizer.log"
    process = start_tokenizer(embedded_model_path, port, log_path)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process, log_path)

        async def stream_through_a_sigterm() -> int:
            client = TokenizerClient(f"127.0.0.1:{port}")
            try:
                call = client.stub.Detokenize()
                await call.write(pb.DetokenizeRequest(token_ids=[504]))
                await call.read()
                process.terminate()
                num_steps_after = 0
                try:
                    while await _step(call) is not grpc.aio.EOF:
                        num_steps_after += 1
                        await asyncio.sleep(0.5)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    pass  # the drain's end cancelled the call
                # The connection stays open, its client too busy to read, until the service has
                # exited: a loaded gateway's. (Blocking this loop is the point.)
                process.wait(30)
                return num_steps_after
            finally:
                await client.close()

        assert asyncio.run(stream_through_a_sigterm()) >= 2  # served while draining
        assert process.returncode == 0
    finally:
        kill_group(process)
        process.wait()
    log = log_path.read_text(errors="replace")
    assert "Traceback" not in log and "ERROR" not in log, log


async def _step(call: grpc.aio.StreamStreamCall) -> object:
    await call.write(pb.DetokenizeRequest(token_ids=[504]))
    return await call.read()


def test_the_service_renders_without_loading_torch(embedded_model_path: Path,
                                                   tmp_path: Path) -> None:
    """transformers imports torch whenever it is installed; the service keeps it out
    (services/tokenizer/without_torch.py), which was most of its start and 300 MB."""
    port, log_path = free_port(), tmp_path / "tokenizer.log"
    process = start_tokenizer(embedded_model_path, port, log_path)
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process, log_path)
        prompt = rendered_prompt(f"127.0.0.1:{port}", [{"role": "user", "content": "Hi"}])
        assert "Hi" in prompt
        assert "libtorch" not in Path(f"/proc/{process.pid}/maps").read_text()
    finally:
        kill_group(process)
        process.wait()
    assert "PyTorch was not found" not in log_path.read_text()
