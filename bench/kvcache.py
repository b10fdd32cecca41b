"""KV-cache service benchmark: cold prefill vs warm-from-service prefill TTFT, per transfer mode.

    python bench/kvcache.py [--modes zmq shm] [--prompt-tokens 1500] [--repeats 2]

For each transfer mode: starts the KV service (LMCache), then one engine with vLLM's own
prefix cache off, so a repeated prompt can only be warm through the service. The engine
serves a short warm-up prompt, the shared prompt once cold, then the same prompt
`--repeats` times warm. Prints one JSON line per mode and the warm/cold ratio (goal <= 0.3).
Needs an interpreter with lmcache and vLLM: this one, or BACKPORT_KVCACHE_PYTHON.

Before each warm request the engine waits until the service holds the prompt's whole
chunks (`store_wait_s`): in the `shm` mode LMCache stores asynchronously, and a request
sent as soon as the cold answer arrives can miss them (docs/kvcache.md). A warm request
that still reports fewer cached tokens than the stored chunks give is a miss: counted in
`warm_misses`, named on stderr, and the run exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from services.embedded_model import embedded_model_path  # noqa: E402
from tests.kvcache.processes import lmcache_python, run_engine_probe, start_kv_service  # noqa: E402

GOAL_RATIO = 0.3


def expected_cached_tokens(prompt_tokens: int, chunk_tokens: int) -> int:
    """Cached tokens vLLM reports for a prompt whose whole chunks all come from the service.

    Only whole chunks are stored; when they cover the whole prompt, vLLM computes the last
    token again (it needs one token to compute), so it reports one fewer.
    """
    stored = prompt_tokens // chunk_tokens * chunk_tokens
    return stored - 1 if stored == prompt_tokens else stored


def summarize_mode(mode: str, prompt_tokens: int, chunk_tokens: int, cold: dict,
                   warm: list[dict]) -> dict:
    """The JSON line of one mode; a warm run that got fewer cached tokens is a miss, not warm."""
    expected = expected_cached_tokens(prompt_tokens, chunk_tokens)
    hits = [r for r in warm if r["cached_tokens"] >= expected]
    warm_ttft_s = statistics.median(r["ttft_s"] for r in hits) if hits else None
    return {"mode": mode, "prompt_tokens": prompt_tokens, "chunk_tokens": chunk_tokens,
            "cold_ttft_s": round(cold["ttft_s"], 4),
            "warm_ttft_s": None if warm_ttft_s is None else round(warm_ttft_s, 4),
            "warm_ttft_runs_s": [round(r["ttft_s"], 4) for r in warm],
            "cached_tokens": [r["cached_tokens"] for r in warm],
            "expected_cached_tokens": expected,
            "warm_misses": len(warm) - len(hits),
            "store_wait_s": [round(r["store_wait_s"], 4) if "store_wait_s" in r else None
                             for r in warm],
            "warm_over_cold": None if warm_ttft_s is None else round(warm_ttft_s / cold["ttft_s"], 3),
            "meets_goal": (len(hits) == len(warm)
                           and warm_ttft_s is not None and warm_ttft_s <= GOAL_RATIO * cold["ttft_s"])}


def measure_mode(python: str, model: Path, mode: str, prompt_tokens: int, repeats: int,
                 chunk_tokens: int, work_dir: Path) -> dict:
    service = start_kv_service(python, work_dir, "--transfer-mode", mode,
                               "--chunk-size-tokens", str(chunk_tokens))
    try:
        shared = f"shared-{mode}:{prompt_tokens}"
        records = run_engine_probe(python, model, service, mode,
                                   ["warmup:256", shared, *[shared] * repeats], work_dir,
                                   "--no-prefix-caching", "--max-tokens", "1",
                                   "--chunk-size", str(chunk_tokens),
                                   "--kv-http-port", str(service.http_port))
    finally:
        service.stop()
    return summarize_mode(mode, prompt_tokens, chunk_tokens, records[1], records[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["zmq", "shm"], choices=["zmq", "shm"])
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="keep the service and engine logs here (default: a temporary folder)")
    args = parser.parse_args()
    # SIGTERM ends the run like Ctrl-C, so the KV service (in its own session) is stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    python = lmcache_python()
    if python is None:
        print("no interpreter with lmcache and vLLM; set BACKPORT_KVCACHE_PYTHON", file=sys.stderr)
        return 2
    model = args.model or embedded_model_path()
    with tempfile.TemporaryDirectory(prefix="bench-kvcache-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        num_misses = 0
        for mode in args.modes:
            result = measure_mode(python, model, mode, args.prompt_tokens, args.repeats,
                                  args.chunk_tokens, log_dir)
            print(json.dumps(result), flush=True)
            if result["warm_misses"]:
                num_misses += result["warm_misses"]
                print(f"{mode}: {result['warm_misses']} of {args.repeats} warm runs got fewer "
                      f"than {result['expected_cached_tokens']} cached tokens "
                      f"({result['cached_tokens']}): they were not warm; their TTFT is left out",
                      file=sys.stderr)
    return 1 if num_misses else 0


if __name__ == "__main__":
    sys.exit(main())
