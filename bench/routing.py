"""Prefix affinity against round robin: TTFT of repeated shared prefixes, same engines, one run.

Run: .venv/bin/python bench/routing.py [--documents 8] [--questions 4] [--document-tokens 768]

Starts a tokenizer, two engines (vLLM prefix caching on) and two gateways over the same
engines: one routes by prefix affinity, the other round robin. Each phase sends its own fresh
documents (so neither finds the other's prefixes cached); every document is asked
`--questions` times with a different short suffix, at concurrency `--concurrency`. Prints
TTFT p50 / mean and the share of prompt tokens vLLM served from its prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from services.mesh.channels import wait_until_serving  # noqa: E402
from tests.conftest import engine_environment, free_port, wait_for_http_ok  # noqa: E402


@dataclass
class PhaseResult:
    policy: str
    ttft_s: list[float]
    prompt_tokens: int
    cached_tokens: int

    def line(self) -> str:
        p50 = statistics.median(self.ttft_s) * 1000
        mean = statistics.fmean(self.ttft_s) * 1000
        hit = self.cached_tokens / max(1, self.prompt_tokens)
        return (f"{self.policy:>12}: TTFT p50 {p50:7.1f} ms  mean {mean:7.1f} ms  "
                f"prefix-cache hit {hit:5.1%}  ({len(self.ttft_s)} requests)")


async def one_request(http: httpx.AsyncClient, url: str, model: str,
                      prompt: list[int]) -> tuple[float, int, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage = None, {}
    async with http.stream("POST", f"{url}/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            # The first generated token, whether or not its text is whole yet.
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    if ttft is None:
        raise RuntimeError("a stream ended without a generated token")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, usage.get("prompt_tokens", 0), cached


async def run_phase(policy: str, url: str, model: str, prompts: list[list[int]],
                    concurrency: int) -> PhaseResult:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    result = PhaseResult(policy, [], 0, 0)

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            ttft, prompt_tokens, cached = await one_request(http, url, model, queue.get_nowait())
            result.ttft_s.append(ttft)
            result.prompt_tokens += prompt_tokens
            result.cached_tokens += cached

    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return result


def workload(rng: random.Random, documents: int, questions: int,
             document_tokens: int) -> list[list[int]]:
    """Each document asked `questions` times, in random order (so round robin cannot keep a
    document on one engine by accident of the arrival pattern)."""
    docs = [[rng.randrange(100, 40_000) for _ in range(document_tokens)] for _ in range(documents)]
    prompts = [doc + [rng.randrange(100, 40_000) for _ in range(12)]
               for _ in range(questions) for doc in docs]
    rng.shuffle(prompts)
    return prompts


class Processes:
    """The services of one run; their output goes to `log_path`."""

    def __init__(self, log_path: Path) -> None:
        self.running: list[subprocess.Popen[bytes]] = []
        self.log_path = log_path

    def spawn(self, *args: str) -> None:
        with self.log_path.open("ab") as log:
            self.running.append(subprocess.Popen(
                [sys.executable, "-m", "services.cli", *args], cwd=REPO_ROOT,
                env=engine_environment(), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))

    def stop(self) -> None:
        for process in reversed(self.running):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.running:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main() -> int:
    # SIGTERM ends the run like Ctrl-C, so the services it started are stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF folder (default: embedded SmolLM2)")
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--document-tokens", type=int, default=768)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from services.embedded_model import ensure_embedded_model

    model_path = args.model or str(ensure_embedded_model())
    tokenizer_port, engine_ports = free_port(), [free_port(), free_port()]
    gateway_ports = {"round_robin": free_port(), "prefix": free_port()}
    processes = Processes(Path(tempfile.mkdtemp(prefix="bench-routing-")) / "services.log")
    print(f"service logs: {processes.log_path}", flush=True)
    try:
        processes.spawn("tokenizer", "--model", model_path, "--port", str(tokenizer_port))
        for port in engine_ports:
            processes.spawn("engine", "--model", model_path, "--port", str(port), "--enforce-eager",
                            "--max-model-len", "2048", "--kv-cache-memory-gib", "1",
                            "--enable-prefix-caching")
        # Gateways read the model from the mesh at start: its services must be up first.
        for port in (tokenizer_port, *engine_ports):
            if not wait_until_serving(f"127.0.0.1:{port}", timeout_s=900):
                raise TimeoutError(f"service on port {port} did not start; see {processes.log_path}")
        for policy, port in gateway_ports.items():
            engines = [arg for p in engine_ports for arg in ("--engine", f"127.0.0.1:{p}")]
            processes.spawn("gateway", "--port", str(port), "--tokenizer",
                            f"127.0.0.1:{tokenizer_port}", "--routing-policy", policy, *engines)
        for port in gateway_ports.values():
            wait_for_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=900)
        model = httpx.get(f"http://127.0.0.1:{gateway_ports['prefix']}/v1/models").json()["data"][0]["id"]
        rng = random.Random(args.seed)
        # Warm both engines and gateways so no phase pays first-request costs.
        for port in gateway_ports.values():
            asyncio.run(run_phase("warmup", f"http://127.0.0.1:{port}/v1", model,
                                  workload(rng, 2, 2, 64), 2))
        results = []
        for policy, port in gateway_ports.items():
            prompts = workload(rng, args.documents, args.questions, args.document_tokens)
            results.append(asyncio.run(run_phase(policy, f"http://127.0.0.1:{port}/v1", model,
                                                 prompts, args.concurrency)))
        print(f"two engines, {args.documents} documents x {args.questions} questions, "
              f"{args.document_tokens}-token documents, concurrency {args.concurrency}")
        for result in results:
            print(result.line())
        by_policy = {r.policy: statistics.median(r.ttft_s) for r in results}
        print(f"TTFT p50 prefix / round robin: {by_policy['prefix'] / by_policy['round_robin']:.2f}")
        return 0
    finally:
        processes.stop()


if __name__ == "__main__":
    sys.exit(main())
