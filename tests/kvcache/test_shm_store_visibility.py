"""A repeated prompt in the `shm` transfer mode, sent as soon as the first answer arrives.

LMCache's `lmcache_driven` store is asynchronous: the engine answers while the server is
still copying the prompt's chunks, and a lookup meanwhile finds none of them (seen here:
4 of 20 and 1 of 12 immediate repeats of a 512-token prompt reported 0 cached tokens; the
`zmq` mode, whose store the engine waits for, 20 of 20 hits). The engine probe, given the
service's HTTP port, waits until the chunks are stored; bench/kvcache.py relies on it and
counts a warm run that still missed as a miss, never as warm.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.kvcache import expected_cached_tokens, summarize_mode
from tests.kvcache.processes import lmcache_python, run_engine_probe, start_kv_service

CHUNK_TOKENS = 256
# Two whole chunks: the whole prompt is stored, and vLLM computes its last token again.
PROMPT_TOKENS = 512
NUM_REPEATED_PROMPTS = 4

SLOW_TESTS_SKIPPED = os.environ.get("BACKPORT_SKIP_SLOW_TESTS") == "1"
PYTHON = None if SLOW_TESTS_SKIPPED else lmcache_python()


def test_expected_cached_tokens_counts_whole_chunks_and_the_recomputed_last_token() -> None:
    assert expected_cached_tokens(1500, 256) == 1280
    assert expected_cached_tokens(512, 256) == 511
    assert expected_cached_tokens(768, 256) == 767
    assert expected_cached_tokens(200, 256) == 0


def test_a_warm_run_that_missed_is_reported_as_a_miss_and_left_out_of_the_warm_ttft() -> None:
    cold = {"ttft_s": 1.0, "cached_tokens": 0}
    hit = {"ttft_s": 0.1, "cached_tokens": 511, "store_wait_s": 0.2}
    miss = {"ttft_s": 1.5, "cached_tokens": 0, "store_wait_s": 0.0}
    line = summarize_mode("shm", PROMPT_TOKENS, CHUNK_TOKENS, cold, [hit, miss])
    assert line["warm_misses"] == 1 and line["cached_tokens"] == [511, 0]
    assert line["warm_ttft_s"] == 0.1 and line["store_wait_s"] == [0.2, 0.0]
    assert line["meets_goal"] is False
    all_missed = summarize_mode("shm", PROMPT_TOKENS, CHUNK_TOKENS, cold, [miss])
    assert all_missed["warm_ttft_s"] is None and all_missed["warm_over_cold"] is None
    assert summarize_mode("shm", PROMPT_TOKENS, CHUNK_TOKENS, cold, [hit])["meets_goal"] is True


@pytest.mark.skipif(SLOW_TESTS_SKIPPED, reason="BACKPORT_SKIP_SLOW_TESTS=1 (an engine start, "
                                                "a minute or two on two cores)")
@pytest.mark.skipif(not SLOW_TESTS_SKIPPED and PYTHON is None,
                    reason="no interpreter with lmcache and vLLM (`make kvcache-deps`, or set "
                           "BACKPORT_KVCACHE_PYTHON)")
def test_immediate_repeats_in_shm_mode_are_warm_once_the_probe_waits_for_the_store(
        tmp_path: Path, embedded_model_path: Path) -> None:
    service = start_kv_service(PYTHON, tmp_path, "--transfer-mode", "shm", "--chunk-size-tokens",
                               str(CHUNK_TOKENS))
    prompts = [f"repeat-{n}:{PROMPT_TOKENS}" for n in range(NUM_REPEATED_PROMPTS)]
    try:
        records = run_engine_probe(PYTHON, embedded_model_path, service, "shm",
                                   [p for prompt in prompts for p in (prompt, prompt)], tmp_path,
                                   "--no-prefix-caching", "--max-tokens", "1",
                                   "--chunk-size", str(CHUNK_TOKENS),
                                   "--kv-http-port", str(service.http_port))
    finally:
        assert service.stop() == 0
    firsts, repeats = records[0::2], records[1::2]
    assert all(r["cached_tokens"] == 0 and "store_wait_s" not in r for r in firsts)
    assert [(r["chunks_stored"], r["chunks_total"]) for r in repeats] \
        == [(2, 2)] * NUM_REPEATED_PROMPTS
    assert [r["cached_tokens"] for r in repeats] \
        == [expected_cached_tokens(PROMPT_TOKENS, CHUNK_TOKENS)] * NUM_REPEATED_PROMPTS
