"""One vLLM engine process wired to the KV service: serves prompts in turn, prints JSON, exits.

    python tests/kvcache/engine_probe.py --model DIR --kv-service HOST:PORT --transfer-mode zmq \
        --chunk-size 256 --records-file PATH --prompt NAME:NUM_TOKENS [--prompt ...] \
        [--no-prefix-caching] [--kv-http-port PORT]

Each `--prompt` is a deterministic prompt of exactly NUM_TOKENS tokens (the same NAME and
length give the same tokens in any process). One JSON line per request in the records file
(not stdout, where vLLM's processes log and can split a line): name,
time to first token, cached prompt tokens as vLLM reports them, greedy token ids, and the
first token's top log-probabilities. Used by the tests and by bench/kvcache.py; the mesh's
engine service gets the same arguments from `services.engine.kv_transfer.engine_kv_args`.

With `--kv-http-port` (the KV service's HTTP port), a prompt served before in this run
waits until the service holds every whole chunk of it: in the `shm` transfer mode LMCache
stores asynchronously, so a repeat sent as soon as the first answer arrives can be looked
up before the chunks are written and miss (docs/kvcache.md). The wait is recorded, and is
not part of the request's times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

PASSAGE = ("The lighthouse keeper wrote down the tides, the ships that passed, the colour of "
           "the sky at dawn and the number of gulls on the rocks. {name} kept every page. ")
# As every test engine (tests/conftest.py's TEST_ENGINE_KV_CACHE_GIB): room for 11k tokens.
KV_CACHE_GIB = 0.5
# LMCache keys chunks by the engine's model name (its path here) and KV world size (one rank).
KV_WORLD_SIZE = 1
STORE_WAIT_TIMEOUT_S = 60.0
STORE_POLL_S = 0.02


def prompt_token_ids(tokenizer, name: str, num_tokens: int) -> list[int]:
    """NUM_TOKENS tokens of numbered sentences about NAME; deterministic for (name, length)."""
    ids: list[int] = []
    line = 0
    while len(ids) < num_tokens:
        ids += tokenizer.encode(f"{line}. " + PASSAGE.format(name=name), add_special_tokens=False)
        line += 1
    return ids[:num_tokens]


def _http_json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def stored_chunks(http_port: int, model: str, ids: list[int]) -> tuple[int, int]:
    """(found, total) whole chunks of `ids` that a lookup would find in the KV service now.

    Asks through LMCache's warm-prefetch API, which runs the lookup's own prefetch without
    locking anything; a chunk still being written counts as not found, as for a lookup.
    """
    base = f"http://127.0.0.1:{http_port}/cache/prefetches"
    submitted = _http_json(base, {"model_name": model, "world_size": KV_WORLD_SIZE,
                                  "token_ids": ids})
    if submitted["status"] == "noop":  # shorter than one chunk: nothing is ever stored
        return 0, 0
    while True:
        status = _http_json(f"{base}/{submitted['request_id']}")
        if status["status"] == "completed":
            return status["found_keys"], status["total_keys"]
        time.sleep(STORE_POLL_S)


def wait_until_stored(http_port: int, model: str, ids: list[int]) -> dict:
    """Waits (up to STORE_WAIT_TIMEOUT_S) until the service holds every whole chunk of `ids`."""
    start = time.perf_counter()
    found, total = stored_chunks(http_port, model, ids)
    while found < total and time.perf_counter() - start < STORE_WAIT_TIMEOUT_S:
        time.sleep(STORE_POLL_S)
        found, total = stored_chunks(http_port, model, ids)
    return {"store_wait_s": time.perf_counter() - start, "chunks_stored": found,
            "chunks_total": total}


def write_record(path: Path, record: dict) -> None:
    with path.open("a") as records:
        records.write(json.dumps(record) + "\n")


async def serve_prompts(args: argparse.Namespace) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from services.engine.kv_transfer import engine_kv_args
    from services.engine.settings import EngineSettings
    from services.engine.vllm_engine import cpu_worker_in_engine_core, engine_dtype, start_async_llm

    kv_args = engine_kv_args(args.model, args.kv_service, args.transfer_mode, args.chunk_size,
                             args.kv_events_endpoint)
    settings = EngineSettings(model=args.model)
    cpu_worker_in_engine_core(settings)
    engine_args = AsyncEngineArgs(
        model=args.model, max_model_len=args.max_model_len, enforce_eager=True,
        dtype=engine_dtype(settings), enable_prefix_caching=args.prefix_caching,
        kv_cache_memory_bytes=int(KV_CACHE_GIB * (1 << 30)), **kv_args)
    llm = start_async_llm(engine_args)
    try:
        tokenizer = llm.get_tokenizer()
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=5,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        write_record(args.records_file, {"event": "ready", "pid": os.getpid()})
        for index, spec in enumerate(args.prompt):
            name, num_tokens = spec.rsplit(":", 1)
            ids = prompt_token_ids(tokenizer, name, int(num_tokens))
            store_visibility: dict[str, float | int] = {}
            if args.kv_http_port is not None and spec in args.prompt[:index]:
                store_visibility = await asyncio.to_thread(wait_until_stored, args.kv_http_port,
                                                           args.model, ids)
            start = time.perf_counter()
            ttft_s = None
            token_ids: list[int] = []
            first_logprobs: dict[int, float] = {}
            num_cached = 0
            async for output in llm.generate(TokensPrompt(prompt_token_ids=ids), params,
                                             uuid.uuid4().hex):
                completion = output.outputs[0]
                if ttft_s is None and completion.token_ids:
                    ttft_s = time.perf_counter() - start
                    first_logprobs = {t: lp.logprob for t, lp in (completion.logprobs or [{}])[0].items()}
                token_ids += completion.token_ids
                num_cached = output.num_cached_tokens or num_cached
            write_record(args.records_file, {
                "event": "request", "name": name, "prompt_tokens": len(ids), "ttft_s": ttft_s,
                "total_s": time.perf_counter() - start, "cached_tokens": num_cached,
                "token_ids": token_ids,
                "first_logprobs": {str(k): v for k, v in first_logprobs.items()},
                **store_visibility})
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-service", default=None)
    parser.add_argument("--transfer-mode", default="zmq")
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--kv-events-endpoint", default=None)
    parser.add_argument("--kv-http-port", type=int, default=None,
                        help="the KV service's HTTP port: a repeated prompt waits until its "
                             "chunks are stored there")
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--records-file", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    asyncio.run(serve_prompts(parser.parse_args()))


if __name__ == "__main__":
    main()
