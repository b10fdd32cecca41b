"""`backport up` and the PLE service: which models get one, and how engines are wired to it.

The tiny Qwen4Exp checkpoint cannot run in vLLM on this CPU build, so no engine starts
here: the launcher starts a real PLE service on a real table, and a child process in the
environment the launcher gives engines turns on vLLM's PLE hook and reads rows through it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.engine.backport.ple.activation import ADDRESS_ENV
from services.launcher import PLE_SERVICE, Mesh, UpSettings
from services.ple_offload.errors import TableFileError
from services.ple_offload.model_table import PleTable, is_qwen4_exp, ple_table_for_model
from services.ple_offload.segment_layout import segment_path
from tests.ple.service_process import REPO_ROOT, free_port, service_env
from tests.ple.table_files import STEM, TableFile, random_rows, write_table


def checkpoint(folder: Path, architecture: str, *, with_table: bool) -> TableFile | None:
    """A checkpoint folder: config.json, a non-table 2-D weight in one file and, when asked,
    the PLE table (two fp8 row shards) in another, as a real checkpoint spreads them."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    write_table(folder / "model-00001-of-00002.safetensors", random_rows(64, 64, seed=5),
                safetensors_dtype="BF16", stem="model.embed_tokens")
    if not with_table:
        return None
    return write_table(folder / "model-00002-of-00002.safetensors", random_rows(50_000, 160, seed=6),
                       safetensors_dtype="F8_E4M3", num_shards=2, scale=0.25)


def test_only_qwen4_exp_checkpoints_with_a_table_get_a_ple_service(tmp_path: Path) -> None:
    table = checkpoint(tmp_path / "qwen4", "Qwen4ExpForCausalLM", with_table=True)
    assert table is not None
    checkpoint(tmp_path / "qwen4-no-table", "Qwen4ExpForCausalLM", with_table=False)
    checkpoint(tmp_path / "llama", "LlamaForCausalLM", with_table=True)

    assert ple_table_for_model(tmp_path / "qwen4", None) == PleTable(tmp_path / "qwen4", STEM)
    assert ple_table_for_model(tmp_path / "qwen4-no-table", table.path) == PleTable(table.path, STEM)
    assert ple_table_for_model(tmp_path / "qwen4-no-table", None) is None
    assert ple_table_for_model(tmp_path / "llama", None) is None
    assert ple_table_for_model(tmp_path / "llama", table.path) is None
    assert ple_table_for_model(tmp_path / "not-a-folder", None) is None

    write_table(tmp_path / "qwen4" / "model-extra.safetensors", random_rows(10, 160, seed=7),
                safetensors_dtype="F8_E4M3", scale=1.0,
                stem="model.layers.9.ple.ple_embedding.ngram_embedding")
    with pytest.raises(TableFileError, match="holds 2 PLE tables"):
        ple_table_for_model(tmp_path / "qwen4", None)


def test_tiny_qwen4_exp_checkpoint_is_recognised(tmp_path: Path) -> None:
    """The tiny builder's model has no PLE layer (ple_layer_ids is empty), so it needs a
    service only when a table is given."""
    pytest.importorskip("transformers.models.qwen4_exp")
    from tests.models.tiny_models import build_qwen4_exp

    folder = build_qwen4_exp(tmp_path / "tiny")
    assert is_qwen4_exp(folder)
    assert ple_table_for_model(folder, None) is None
    table = write_table(tmp_path / "table.safetensors", random_rows(100, 160, seed=8),
                        safetensors_dtype="F8_E4M3", scale=1.0)
    assert ple_table_for_model(folder, table.path) == PleTable(table.path, STEM)


def test_up_serves_the_checkpoint_table_to_engines_and_stops_it_last(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    table = checkpoint(tmp_path / "qwen4", "Qwen4ExpForCausalLM", with_table=True)
    assert table is not None
    port = free_port()
    mesh = Mesh(UpSettings(model=str(tmp_path / "qwen4"), ple_port=port, startup_timeout_s=120))
    try:
        mesh._start_ple()
        engine_env = mesh._engine_env(None)
        assert engine_env[ADDRESS_ENV] == f"127.0.0.1:{port}"
        ids = np.array([0, 24_999, 25_000, 49_999, 12_345])
        probe = subprocess.run(
            [sys.executable, "-m", "tests.ple.engine_env_probe", *map(str, ids)],
            cwd=REPO_ROOT, env=service_env() | engine_env, capture_output=True, text=True,
            timeout=300)
        assert probe.returncode == 0, probe.stderr[-3000:]
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        assert seen == {"installed": True, "address": f"127.0.0.1:{port}", "local": True,
                        "rows_sha256": hashlib.sha256(table.rows[ids].tobytes()).hexdigest()}
    finally:
        mesh.stop()
    (service,) = [s for s in mesh.services if s.name == PLE_SERVICE]
    assert service.process.returncode == 0
    assert not segment_path(f"backport-ple-{port}").exists()
