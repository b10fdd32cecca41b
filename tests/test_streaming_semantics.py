"""How generated tokens become text: the tokenizer service and the gateway as real processes over
real gRPC, on a sentencepiece-style tokenizer (the embedded model's byte-level one keeps its spaces
whatever the detokenizer does).

The engine is a fake: a real one sends a chunk of several tokens only when its outputs merge under
load, which a test cannot arrange.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from backport.v1 import common_pb2
from backport.v1 import engine_pb2 as pb
from backport.v1 import engine_pb2_grpc
from services.tokenizer.client import TOKEN_TEXT_CACHE_SIZE, TokenizerClient
from tests.cluster.processes import kill_group, start_tokenizer
from tests.conftest import (REPO_ROOT, ProcessExitedError, engine_environment, free_port,
                            wait_for_grpc_serving, wait_for_http_ok)

START_TIMEOUT_S = 120.0
# A word-level vocabulary whose words carry sentencepiece's "▁" space marker, as Llama-2's and
# Mistral's do; the Metaspace decoder drops the marker's space on a sequence's first word.
SENTENCEPIECE_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁of": 5,
                       "▁France": 6, "▁is": 7, "▁Paris": 8, ".": 9}
# Filler words past the gateway's cache of token texts, as large vocabularies (Llama 3, Qwen) are.
NUM_FILLER_WORDS = TOKEN_TEXT_CACHE_SIZE + 1000
VOCAB = SENTENCEPIECE_VOCAB | {f"▁w{i}": len(SENTENCEPIECE_VOCAB) + i for i in range(NUM_FILLER_WORDS)}


def write_sentencepiece_style_tokenizer(folder: Path) -> None:
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))


@pytest.fixture(scope="module")
def sentencepiece_tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sentencepiece-tokenizer")
    write_sentencepiece_style_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def sentencepiece_tokenizer_address(sentencepiece_tokenizer_folder: Path) -> Iterator[str]:
    port = free_port()
    process = start_tokenizer(sentencepiece_tokenizer_folder, port,
                              sentencepiece_tokenizer_folder / "tokenizer.log")
    try:
        wait_for_grpc_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, process)
        yield f"127.0.0.1:{port}"
    finally:
        kill_group(process)
        process.wait()


def test_a_completion_keeps_the_space_before_its_first_word(sentencepiece_tokenizer_address: str) -> None:
    async def complete() -> tuple[str, str]:
        client = TokenizerClient(sentencepiece_tokenizer_address)
        try:
            prompt = await client.encode("The capital of France is", add_special_tokens=False)
            completion = [SENTENCEPIECE_VOCAB["▁Paris"], SENTENCEPIECE_VOCAB["."]]
            whole = await client.decode(prompt + completion, skip_special_tokens=True)
            detokenizer = client.detokenizer(skip_special_tokens=True, prompt_token_ids=prompt)
            try:
                streamed = [await detokenizer.step([token_id]) for token_id in completion]
            finally:
                detokenizer.close()
            return whole, "".join(streamed)
        finally:
            await client.close()

    whole, streamed = asyncio.run(complete())
    assert whole == "The capital of France is Paris."
    # As vLLM's server answers: the prompt and its completion join to the whole text.
    assert streamed == " Paris."


def test_token_texts_stay_right_when_the_cache_of_them_fills(sentencepiece_tokenizer_address: str) -> None:
    async def texts_after_filling_the_cache() -> list[str]:
        client = TokenizerClient(sentencepiece_tokenizer_address)
        try:
            await client.token_texts(list(range(TOKEN_TEXT_CACHE_SIZE - 1)))
            # "▁Paris" is cached; the two filler words asked with it overflow the cache.
            uncached = range(TOKEN_TEXT_CACHE_SIZE, TOKEN_TEXT_CACHE_SIZE + 2)
            return await client.token_texts([SENTENCEPIECE_VOCAB["▁Paris"], *uncached])
        finally:
            await client.close()

    paris, *fillers = asyncio.run(texts_after_filling_the_cache())
    assert paris.strip() == "Paris"
    assert [f.strip() for f in fillers] == [f"w{TOKEN_TEXT_CACHE_SIZE - len(SENTENCEPIECE_VOCAB) + i}"
                                           for i in range(2)]


# What the fake engine generates for every choice, in one chunk: " Paris. The capital".
SCRIPTED_TOKEN_IDS = [SENTENCEPIECE_VOCAB[word] for word in ("▁Paris", ".", "▁The", "▁capital")]
FAKE_MODEL = "fake-sentencepiece"
# How long the fake engine keeps a request open after its chunk unless the gateway cancels it:
# long enough that a loaded CI machine never mistakes slowness for a request left running.
FAKE_GENERATION_S = 60.0


class FakeEngineServicer(engine_pb2_grpc.EngineServicer):
    """Sends each choice's tokens as one chunk, then stays busy until cancelled, noting whether
    it was."""

    def __init__(self, tokenizer_folder: Path) -> None:
        self.tokenizer_folder = tokenizer_folder
        self.cancelled_request_ids: list[str] = []

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        return pb.ModelInfo(served_model_name=FAKE_MODEL, max_model_len=512,
                            vocab_size=len(VOCAB), eos_token_ids=[SENTENCEPIECE_VOCAB["</s>"]],
                            tokenizer=str(self.tokenizer_folder), architecture="FakeForCausalLM")

    def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.ServicerContext) -> pb.Loads:
        return pb.Loads()

    def Generate(self, request: pb.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        num_choices = max(1, request.sampling.n)
        num_tokens = len(SCRIPTED_TOKEN_IDS)
        # Noted when the call ends, however it ends: a cancel that arrives while this generator
        # waits at a `yield` (a loaded machine) ends the call without resuming it.
        ended_on_its_own = False

        def note_cancel() -> None:
            if not ended_on_its_own:
                self.cancelled_request_ids.append(request.request_id)

        context.add_callback(note_cancel)
        for index in range(num_choices):
            yield pb.GenerateResponse(chunk=pb.GenerateChunk(
                index=index, token_ids=SCRIPTED_TOKEN_IDS,
                logprobs=[pb.TokenLogprob(token_id=t, logprob=-0.5) for t in SCRIPTED_TOKEN_IDS],
                prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_tokens))
        deadline = time.monotonic() + FAKE_GENERATION_S
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not context.is_active():
            return
        ended_on_its_own = True
        for index in range(num_choices):
            yield pb.GenerateResponse(complete=pb.GenerateComplete(
                index=index, finish_reason=common_pb2.FINISH_REASON_LENGTH,
                prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_tokens))


@dataclass
class FakeEngineMesh:
    base_url: str
    engine: FakeEngineServicer


@pytest.fixture(scope="module")
def fake_engine_mesh(sentencepiece_tokenizer_folder: Path, sentencepiece_tokenizer_address: str,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeEngineMesh]:
    engine = FakeEngineServicer(sentencepiece_tokenizer_folder)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    engine_port = free_port()
    server.add_insecure_port(f"127.0.0.1:{engine_port}")
    server.start()
    port = free_port()
    log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with log_path.open("wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "gateway", "--port", str(port),
             "--engine", f"127.0.0.1:{engine_port}", "--tokenizer", sentencepiece_tokenizer_address],
            cwd=REPO_ROOT, env=engine_environment(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        wait_for_http_ok(f"http://127.0.0.1:{port}/health", START_TIMEOUT_S, gateway)
        yield FakeEngineMesh(f"http://127.0.0.1:{port}/v1", engine)
    except ProcessExitedError:
        raise RuntimeError(log_path.read_text(errors="replace")[-4000:]) from None
    finally:
        kill_group(gateway)
        gateway.wait()
        server.stop(grace=None)


def _wait_for_cancellations(engine: FakeEngineServicer, num_requests: int) -> None:
    # Well inside FAKE_GENERATION_S, after which a request not cancelled ends on its own.
    deadline = time.monotonic() + FAKE_GENERATION_S * 0.75
    while len(engine.cancelled_request_ids) < num_requests and time.monotonic() < deadline:
        time.sleep(0.05)


def test_tokens_after_a_stop_string_in_the_same_chunk_are_not_counted_nor_given_logprobs(
        fake_engine_mesh: FakeEngineMesh) -> None:
    client = openai.OpenAI(base_url=fake_engine_mesh.base_url, api_key="unused", max_retries=0, timeout=60)
    request = dict(model=FAKE_MODEL, prompt="The capital of France is", n=2, temperature=1.0,
                   max_tokens=16, stop=["."], logprobs=0)
    started = time.monotonic()
    full = client.completions.create(**request)  # type: ignore[call-overload]
    # The engine request was aborted once both choices stopped, not run to its end.
    assert time.monotonic() - started < FAKE_GENERATION_S / 2
    assert [(c.index, c.text, c.finish_reason) for c in full.choices] == [(0, " Paris", "stop"),
                                                                          (1, " Paris", "stop")]
    # " Paris" and the "." that completed the stop string; " The capital" came after it.
    assert [len(c.logprobs.tokens) for c in full.choices] == [2, 2]
    assert full.usage.completion_tokens == 4

    chunks = list(client.completions.create(**request, stream=True,  # type: ignore[call-overload]
                                            stream_options={"include_usage": True}))
    texts, num_logprobs, finish_reasons = ["", ""], [0, 0], [None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            num_logprobs[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
            finish_reasons[choice.index] = choice.finish_reason or finish_reasons[choice.index]
    assert texts == [" Paris", " Paris"] and finish_reasons == ["stop", "stop"]
    assert num_logprobs == [2, 2]
    assert chunks[-1].usage.completion_tokens == 4
    _wait_for_cancellations(fake_engine_mesh.engine, 2)
    assert len(fake_engine_mesh.engine.cancelled_request_ids) == 2, fake_engine_mesh.engine.cancelled_request_ids
