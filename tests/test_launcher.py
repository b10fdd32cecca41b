"""`backport up` refuses what it cannot serve (a taken port, a broken PLE table) before it
starts any service, with one line that says why; stopped, it gives its services their drain."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT, engine_environment, free_port, start_mesh, stop_mesh

REFUSAL_TIMEOUT_S = 60.0
# `up --stop-timeout-s`: short, so that a stream outlasting it takes seconds, not half a minute.
STOP_TIMEOUT_S = 3.0
# The gateway at once, then the tokenizer and the engine with nothing in flight.
SECOND_SIGNAL_STOP_S = 60.0


def test_up_names_a_taken_port_before_starting_anything(embedded_model_path: Path) -> None:
    port, engine_port, tokenizer_port = free_port(), free_port(2), free_port()
    command = [sys.executable, "-m", "services.cli", "up", "--model", str(embedded_model_path),
               "--port", str(port), "--engine-port", str(engine_port), "--engines", "2",
               "--tokenizer-port", str(tokenizer_port), "--enforce-eager"]
    with socket.create_server(("127.0.0.1", engine_port + 1)):
        started = time.monotonic()
        finished = subprocess.run(command, cwd=REPO_ROOT, env=engine_environment(),
                                  capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S)
    assert finished.returncode == 1, finished.stderr[-3000:]
    assert f"{engine_port + 1} (--engine-port)" in finished.stderr
    assert "starting" not in finished.stderr, "a service was started before the port check"
    assert time.monotonic() - started < REFUSAL_TIMEOUT_S


def test_up_names_a_model_folder_that_is_not_there_before_starting_anything(tmp_path: Path) -> None:
    """The tokenizer's child was started on it and failed with transformers' traceback."""
    model = tmp_path / "no-such-model"
    command = [sys.executable, "-m", "services.cli", "up", "--model", str(model),
               "--port", str(free_port()), "--engine-port", str(free_port()),
               "--tokenizer-port", str(free_port())]
    finished = subprocess.run(command, cwd=REPO_ROOT, env=engine_environment(),
                              capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S)
    assert finished.returncode == 1, finished.stderr[-3000:]
    assert "Traceback" not in finished.stderr and "starting" not in finished.stderr
    assert f"--model {model}: no such folder" in finished.stderr


def test_up_names_a_broken_ple_table_without_a_traceback(tmp_path: Path) -> None:
    model = tmp_path / "qwen4-exp"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForCausalLM"]}))
    (model / "model.safetensors").write_bytes(b"truncated")
    command = [sys.executable, "-m", "services.cli", "up", "--model", str(model),
               "--port", str(free_port()), "--engine-port", str(free_port()),
               "--tokenizer-port", str(free_port()), "--ple-port", str(free_port())]
    finished = subprocess.run(command, cwd=REPO_ROOT, env=engine_environment(),
                              capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S)
    assert finished.returncode == 1, finished.stderr[-3000:]
    assert "Traceback" not in finished.stderr
    assert f"ERROR [up] services.launcher: {model / 'model.safetensors'}:" in finished.stderr


def test_sigterm_gives_the_gateway_s_open_stream_its_whole_drain_and_a_second_ends_it(
        tmp_path: Path) -> None:
    """`up` killed each tier its stop timeout after SIGTERM: a stream the gateway's drain was
    finishing was cut without its end. A second signal stops the mesh at once."""
    mesh = start_mesh(tmp_path, "--drain-timeout-s", "300", "--stop-timeout-s", str(STOP_TIMEOUT_S))
    try:
        body = {"model": "SmolLM2-135M-Instruct-bf16", "prompt": "Once upon a time",
                "max_tokens": 8000, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{mesh.base_url}/completions", json=body, timeout=120) as reply:
            lines = reply.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            mesh.process.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            for line in lines:
                assert line != "data: [DONE]", "decoded too fast to outlast the stop timeout"
                if time.monotonic() - stopped_at > STOP_TIMEOUT_S + 5:
                    break
            else:
                pytest.fail("the stream ended within the stop timeout, before its drain did")
            # The stream still open and unread: the gateway would drain it for minutes.
            mesh.process.send_signal(signal.SIGTERM)
            assert mesh.process.wait(timeout=SECOND_SIGNAL_STOP_S) == 0, mesh.log_tail()
    finally:
        stop_mesh(mesh)
