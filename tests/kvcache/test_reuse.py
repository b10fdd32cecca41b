"""Prefix reuse across engine processes through the KV service, with real LMCache and vLLM.

Each engine here is its own process that serves a prompt and exits; the next one starts
afterwards, so every cached token it reports came from the KV service. Two engine starts
per test, a few minutes each on two cores; they run wherever an interpreter has both
lmcache and vLLM (`make test` installs LMCache), and `BACKPORT_SKIP_SLOW_TESTS=1` skips them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import psutil

from services.kvcache.shm_segments import is_process_alive, lmcache_segment_files, mapped_shm_bytes
from tests.kvcache.processes import (
    KvService,
    lmcache_python,
    run_engine_probe,
    start_kv_service,
)

PROMPT = "shared:1500"
CHUNK_TOKENS = 256
# Only whole chunks are stored: 1,500 tokens hold five 256-token chunks.
MIN_CACHED_TOKENS = 1500 // CHUNK_TOKENS * CHUNK_TOKENS
# bf16 KV restored from the service can flip a near-tie in greedy decoding.
LOGPROB_TOLERANCE = 0.1
# LMCache drops a silent worker after 30 s; the service unlinks dead engines' segments every 5 s.
SHM_RELEASE_WAIT_S = 60.0

SLOW_TESTS_SKIPPED = os.environ.get("BACKPORT_SKIP_SLOW_TESTS") == "1"
# Probing for lmcache starts an interpreter; not worth it for tests that will not run.
PYTHON = None if SLOW_TESTS_SKIPPED else lmcache_python()
pytestmark = [
    pytest.mark.skipif(SLOW_TESTS_SKIPPED, reason="BACKPORT_SKIP_SLOW_TESTS=1 (two engine starts "
                                                  "each, minutes on two cores)"),
    pytest.mark.skipif(not SLOW_TESTS_SKIPPED and PYTHON is None,
                       reason="no interpreter with lmcache and vLLM (`make kvcache-deps`, or set "
                              "BACKPORT_KVCACHE_PYTHON)"),
]


def assert_same_greedy_answer(cold: dict, warm: dict) -> None:
    if cold["token_ids"] == warm["token_ids"]:
        return
    # A flipped near-tie: the first token's distribution must still agree.
    shared = set(cold["first_logprobs"]) & set(warm["first_logprobs"])
    assert shared, (cold, warm)
    for token in shared:
        assert abs(cold["first_logprobs"][token] - warm["first_logprobs"][token]) < LOGPROB_TOLERANCE, \
            f"greedy texts differ and token {token}'s first logprob moved more than {LOGPROB_TOLERANCE}"


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def zmq_service_with_disk(tmp_path: Path) -> Iterator[tuple[KvService, Path]]:
    disk = tmp_path / "l2"
    service = start_kv_service(PYTHON, tmp_path, "--transfer-mode", "zmq", "--chunk-size-tokens",
                               str(CHUNK_TOKENS), "--fs-l2-path", str(disk))
    yield service, disk
    service.stop()


def test_engine_started_after_another_and_a_service_restart_gets_its_prefix_from_disk(
        zmq_service_with_disk: tuple[KvService, Path], embedded_model_path: Path,
        log_dir: Path) -> None:
    # Reuse between engines of one live service is test_mesh_kv_cache.py's; here the second
    # engine starts after the first has exited and after the service itself restarted.
    service, disk = zmq_service_with_disk
    [cold] = run_engine_probe(PYTHON, embedded_model_path, service, "zmq", [PROMPT], log_dir)
    assert cold["cached_tokens"] == 0

    # A new service process on the same disk tier: its memory is empty, the disk is not.
    assert service.stop() == 0
    restarted = start_kv_service(PYTHON, log_dir, "--transfer-mode", "zmq", "--chunk-size-tokens",
                                 str(CHUNK_TOKENS), "--fs-l2-path", str(disk))
    try:
        [from_disk] = run_engine_probe(PYTHON, embedded_model_path, restarted, "zmq", [PROMPT],
                                       log_dir)
    finally:
        assert restarted.stop() == 0
    assert from_disk["cached_tokens"] >= MIN_CACHED_TOKENS
    assert_same_greedy_answer(cold, from_disk)


def held_shared_memory(service: KvService) -> int:
    """Bytes of exited engines' LMCache segments still named in /dev/shm plus those the
    service's processes map. Live engines' segments are left out: other tests' engines
    run beside this one under pytest-xdist."""
    named = sum(s.num_bytes for s in lmcache_segment_files()
                if s.owner_pid is not None and not is_process_alive(s.owner_pid))
    tree = [service.process.pid] + [c.pid for c in psutil.Process(service.process.pid).children(
        recursive=True)]
    return named + sum(mapped_shm_bytes(pid) for pid in tree)


def wait_for_release(service: KvService, at_most: int) -> int:
    deadline = time.monotonic() + SHM_RELEASE_WAIT_S
    held = held_shared_memory(service)
    while held > at_most and time.monotonic() < deadline:
        time.sleep(2.0)
        held = held_shared_memory(service)
    return held


def test_engine_restarts_in_shm_mode_do_not_grow_shared_memory(
        tmp_path: Path, embedded_model_path: Path, log_dir: Path) -> None:
    service = start_kv_service(PYTHON, tmp_path, "--transfer-mode", "shm", "--chunk-size-tokens",
                               str(CHUNK_TOKENS))
    try:
        baseline = held_shared_memory(service)
        [cold] = run_engine_probe(PYTHON, embedded_model_path, service, "shm", [PROMPT], log_dir)
        [warm] = run_engine_probe(PYTHON, embedded_model_path, service, "shm", [PROMPT], log_dir)
        # One wait, after both: a segment of the first engine that stayed would show here too.
        after_both = wait_for_release(service, baseline)
    finally:
        assert service.stop() == 0
    assert warm["cached_tokens"] >= MIN_CACHED_TOKENS
    assert_same_greedy_answer(cold, warm)
    # Each engine's KV cache (0.5 GiB here) was in shared memory while it ran; none stays.
    assert after_both <= baseline, (baseline, after_both)
    assert not [s for s in lmcache_segment_files()
                if s.owner_pid is not None and not is_process_alive(s.owner_pid)]
