"""`backport up` refuses what it cannot serve (a taken port, a broken PLE table) before it
starts any service, with one line that says why."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO_ROOT, engine_environment, free_port

REFUSAL_TIMEOUT_S = 60.0


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
