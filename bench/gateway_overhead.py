"""Gateway overhead: the same model and load against vLLM's own OpenAI server, then the mesh.

Run: .venv/bin/python bench/gateway_overhead.py [--requests 32] [--max-tokens 64]
Prints throughput ratio (mesh / direct) and TTFT / inter-token latency deltas at
concurrency 1 and 16. Both servers run one after the other on the same machine with the
same engine settings (eager mode, same KV cache size), so the ratio isolates the serving layer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.conftest import free_port, wait_for_http_ok  # noqa: E402

KV_CACHE_BYTES = 2 * 2**30
PROMPT = "Tell me a long story about a lighthouse keeper and the sea."


@dataclass
class LoadResult:
    ttft_s: list[float]
    itl_s: list[float]
    output_tokens: int
    wall_s: float

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_s


async def one_request(http: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> tuple[float, list[float], int]:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with http.stream("POST", f"{url}/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    ttft = arrivals[0] - start
    return ttft, [b - a for a, b in zip(arrivals, arrivals[1:])], tokens


async def run_load(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int) -> LoadResult:
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await one_request(http, url, model, 4)  # warm-up
        semaphore = asyncio.Semaphore(concurrency)

        async def bounded() -> tuple[float, list[float], int]:
            async with semaphore:
                return await one_request(http, url, model, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded() for _ in range(num_requests)))
        wall = time.perf_counter() - start
    return LoadResult([r[0] for r in results], [x for r in results for x in r[1]],
                      sum(r[2] for r in results), wall)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def measure(name: str, command: list[str], health_url: str, url: str, model: str,
            args: argparse.Namespace) -> dict[int, LoadResult]:
    print(f"starting {name} ...", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_http_ok(health_url, timeout_s=900, process=process)
        return {c: asyncio.run(run_load(url, model, c, args.requests, args.max_tokens))
                for c in (1, 16)}
    finally:
        stop(process)


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    # SIGTERM ends the run like Ctrl-C, so the server it started (in its own session) is
    # stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    model_path = subprocess.run([sys.executable, "-m", "services.cli", "model-path"], cwd=REPO_ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()
    model = Path(model_path).name

    port = free_port()
    direct = measure("vLLM OpenAI server", [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
        "--served-model-name", model, "--port", str(port), "--enforce-eager",
        "--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--no-enable-log-requests"], f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/v1",
        model, args)
    port = free_port()
    mesh = measure("backport mesh", [
        sys.executable, "-m", "services.cli", "up", "--model", model_path, "--port", str(port),
        "--engine-port", str(free_port()), "--tokenizer-port", str(free_port()), "--enforce-eager",
        "--max-model-len", str(args.max_model_len), "--kv-cache-memory-gib", str(KV_CACHE_BYTES / 2**30)],
        f"http://127.0.0.1:{port}/health",
        f"http://127.0.0.1:{port}/v1", model, args)

    print(f"\n{args.requests} streamed chats per level, {args.max_tokens} tokens each, greedy")
    print(f"{'conc':>4} {'direct tok/s':>12} {'mesh tok/s':>10} {'ratio':>6} "
          f"{'TTFT p50 direct':>15} {'mesh':>8} {'delta ms':>9} {'ITL p50 direct':>14} {'mesh':>8} {'delta ms':>9}")
    for c in (1, 16):
        d, m = direct[c], mesh[c]
        print(f"{c:>4} {d.throughput:>12.1f} {m.throughput:>10.1f} {m.throughput / d.throughput:>6.3f} "
              f"{p50(d.ttft_s) * 1e3:>15.1f} {p50(m.ttft_s) * 1e3:>8.1f} "
              f"{(p50(m.ttft_s) - p50(d.ttft_s)) * 1e3:>9.1f} {p50(d.itl_s) * 1e3:>14.2f} "
              f"{p50(m.itl_s) * 1e3:>8.2f} {(p50(m.itl_s) - p50(d.itl_s)) * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
