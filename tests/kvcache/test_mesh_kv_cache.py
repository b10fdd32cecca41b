"""`backport up --kv-cache`: the engine service reuses another engine's prefix through the KV service.

Two engines behind a round-robin gateway, both wired to the LMCache server the launcher
started first. The first request (a ~1,500-token prompt) runs cold on one engine; the
second, the same prompt, goes to the other engine, whose own prefix cache has never seen
it: every cached token it reports came from the KV service. Skipped where lmcache is not
importable (`make kvcache-deps` installs it; `make test` does).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import RunningMesh, free_port, start_mesh, stop_mesh

MODEL = "SmolLM2-135M-Instruct-bf16"
CHUNK_TOKENS = 256
PROMPT_LINE = ("{n}. The lighthouse keeper wrote down the tides, the ships that passed, the "
               "colour of the sky at dawn and the number of gulls on the rocks. ")
# bf16 KV restored from the service can flip a greedy near-tie; the distribution must still agree.
LOGPROB_TOLERANCE = 0.1

HAS_LMCACHE = importlib.util.find_spec("lmcache") is not None
needs_lmcache = pytest.mark.skipif(not HAS_LMCACHE, reason="lmcache is not importable here: "
                                   "`make kvcache-deps` installs LMCache 0.5.6 for --kv-cache")


def long_prompt(num_lines: int = 44) -> str:
    """About 1,500 tokens of SmolLM2's tokenizer (34 per line)."""
    return "".join(PROMPT_LINE.format(n=n) for n in range(num_lines))


def generate_requests_served(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("backport:engine_generate_requests_total{"))


def test_kv_cache_is_refused_before_anything_starts(embedded_model_path: Path) -> None:
    """Without LMCache, or with a chunk size that splits the model's KV blocks, `backport up
    --kv-cache` stops at once with a message that says what to do. Every port is a test port:
    `up` checks them first, and a default one (50052) may be a client's ephemeral port."""
    refused = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--model", str(embedded_model_path),
         "--kv-cache", "--kv-cache-port", str(free_port()), "--kv-cache-http-port", str(free_port()),
         "--kv-chunk-size-tokens", "200", "--port", str(free_port()),
         "--engine-port", str(free_port()), "--tokenizer-port", str(free_port())],
        capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1
    if HAS_LMCACHE:
        assert "KV chunk size 200 does not fit" in refused.stderr, refused.stderr
        assert "Use 128 or 256" in refused.stderr
    else:
        assert "run `make kvcache-deps`" in refused.stderr, refused.stderr
    assert "starting tokenizer" not in refused.stderr


@pytest.fixture(scope="module")
def kv_mesh(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[RunningMesh, int]]:
    metrics_port = free_port(2)  # one metrics port an engine
    with pytest.MonkeyPatch.context() as env:
        # LMCache allocates its whole L1 at start; 1 GiB holds this test's chunks many times.
        env.setenv("BACKPORT_KVCACHE_L1_SIZE_GIB", "1")
        running = start_mesh(
            tmp_path_factory.mktemp("kv-mesh"), "--kv-cache", "--kv-cache-port", str(free_port()),
            "--kv-cache-http-port", str(free_port()), "--kv-chunk-size-tokens", str(CHUNK_TOKENS),
            "--engines", "2", "--routing-policy", "round_robin", "--max-model-len", "2048",
            "--kv-cache-memory-gib", "1", "--engine-metrics-port", str(metrics_port))
    yield running, metrics_port
    stop_mesh(running)


@needs_lmcache
def test_second_engine_gets_the_prefix_from_the_kv_service(
        kv_mesh: tuple[RunningMesh, int]) -> None:
    mesh, metrics_port = kv_mesh
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=600)
    prompt = long_prompt()

    def complete() -> openai.types.Completion:
        return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8,
                                         logprobs=5)

    cold = complete()
    assert 1400 <= cold.usage.prompt_tokens <= 1600
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = complete()
    # Round robin: each engine served one request, so the second engine never computed this prompt.
    assert [generate_requests_served(metrics_port + i) for i in (0, 1)] == [1.0, 1.0]
    # Only whole chunks are stored, and the last prompt token is always computed: every whole
    # 256-token chunk before it comes back (1,280 of ~1,500 tokens).
    assert warm.usage.prompt_tokens_details.cached_tokens >= \
        (cold.usage.prompt_tokens - 1) // CHUNK_TOKENS * CHUNK_TOKENS > 0
    if warm.choices[0].text == cold.choices[0].text:
        return
    cold_first = cold.choices[0].logprobs.top_logprobs[0]
    warm_first = warm.choices[0].logprobs.top_logprobs[0]
    shared = cold_first.keys() & warm_first.keys()
    assert shared, (cold_first, warm_first)
    for token in shared:
        assert abs(cold_first[token] - warm_first[token]) < LOGPROB_TOLERANCE, (token, cold_first,
                                                                                warm_first)
    warnings.warn(f"greedy texts differ after KV reuse (bf16 near-tie): {cold.choices[0].text!r} "
                  f"vs {warm.choices[0].text!r}; first-token logprobs agree within "
                  f"{LOGPROB_TOLERANCE}")


@needs_lmcache
def test_the_kv_service_shares_a_salted_prefix_only_under_its_salt(
        kv_mesh: tuple[RunningMesh, int]) -> None:
    """`cache_salt` isolates tenants in the shared KV service too, not only in each engine's
    prefix cache: round robin sends each request to the other engine."""
    mesh, _ = kv_mesh
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=600)
    prompt = "Salted. " + long_prompt(num_lines=16)  # about 550 tokens: two whole chunks

    def cached_tokens(salt: str) -> int:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                          extra_body={"cache_salt": salt})
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens("tenant-a") == 0  # stored in the service under tenant-a's salt
    assert cached_tokens("tenant-b") == 0  # the other engine, another salt: nothing shared
    cached_tokens("tenant-a")  # back on the first engine, to send the next to the second
    assert cached_tokens("tenant-a") >= CHUNK_TOKENS  # the other engine, the same salt
