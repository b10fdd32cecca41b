"""A standalone engine process started with a setting it cannot serve with: refused in one
line, before vLLM loads the model."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.cluster.processes import kill_group, start_engine
from tests.conftest import free_port

# Importing vLLM takes ~20 s on two busy cores; loading the model, starting its engine core
# and warming it up takes a minute more.
REFUSAL_TIMEOUT_S = 300.0
ENGINE_ARGS = ("--max-model-len", "512", "--kv-cache-memory-gib", "0.5")


def test_a_taken_metrics_port_stops_the_engine_naming_it_before_the_model_loads(
        embedded_model_path: Path, tmp_path: Path) -> None:
    """It was found only once the model had loaded and the gRPC server was serving, as an
    OSError traceback, then a second one from the gRPC server the failure left unstopped."""
    metrics_port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", metrics_port))
        holder.listen()
        returncode, log = _run_engine(embedded_model_path, tmp_path,
                                      "--metrics-port", str(metrics_port))
    assert returncode == 1, log
    assert f"127.0.0.1:{metrics_port}" in log and "already in use" in log, log
    _assert_refused_before_the_model_loads(log)


@pytest.mark.parametrize("redis_url", ["127.0.0.1:6379", "http://127.0.0.1:6379/0"])
def test_a_redis_url_that_is_none_stops_the_engine_naming_it_before_the_model_loads(
        embedded_model_path: Path, tmp_path: Path, redis_url: str) -> None:
    """redis-py refused it only where the engine registers, once the model had loaded and the
    gRPC server was serving: a ValueError traceback, then the unstopped server's. Now the
    settings refuse it, as any other bad flag."""
    returncode, log = _run_engine(embedded_model_path, tmp_path, "--redis-url", redis_url)
    assert returncode == 2, log
    assert f"--redis-url={redis_url!r}: Value error, not a Redis URL" in log and "redis://" in log, log
    _assert_refused_before_the_model_loads(log)


def _run_engine(model: Path, log_dir: Path, *args: str) -> tuple[int, str]:
    log_path = log_dir / "engine.log"
    process = start_engine(model, free_port(), log_path, *ENGINE_ARGS, *args)
    try:
        process.wait(timeout=REFUSAL_TIMEOUT_S)
    finally:
        kill_group(process)
        process.wait()
    return process.returncode, log_path.read_text(errors="replace")


def _assert_refused_before_the_model_loads(log: str) -> None:
    assert "Traceback" not in log, log
    assert "Starting to load model" not in log, log
