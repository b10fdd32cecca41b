"""The service's settings: a bad value stops `backport ple` with the flag's name and status 2
before it reads the table, `--shm-dir` reaches engines as a path they can use, and the
engines' BACKPORT_PLE_ADDRESS is not the service's listen address."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from services.engine.backport.ple.activation import ADDRESS_ENV
from services.ple_offload.client import PleTableClient
from services.ple_offload.settings import LISTEN_ADDRESS_ENV, PleSettings
from tests.ple.service_process import (
    CLI_ENTRY,
    REPO_ROOT,
    ServiceProcess,
    free_port,
    service_command,
    service_env,
)
from tests.ple.table_files import TableFile, random_rows, write_table


@pytest.fixture(scope="module")
def tiny_table(tmp_path_factory: pytest.TempPathFactory) -> TableFile:
    path = tmp_path_factory.mktemp("ple-settings") / "tiny.safetensors"
    return write_table(path, random_rows(1000, 320, seed=9), safetensors_dtype="BF16")


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--expect-dtype", "fp16", "unknown row dtype 'fp16'"),
    ("--shm-name", "ple/table", "must be a file name"),
    ("--shm-name", "..", "must be a file name"),
    ("--shm-dir", "/no/such/tmpfs", "is not a folder"),
    ("--expect-header-sha256", "c0ffee", "a SHA-256 is 64 hex digits"),
], ids=["dtype", "slash in name", "dot-dot name", "missing folder", "short sha256"])
def test_a_bad_value_is_refused_by_its_flag(tiny_table: TableFile, flag: str, value: str,
                                            message: str) -> None:
    """Before, each of these ended in a traceback (ValueError, FileNotFoundError,
    FileExistsError or TableFileError) once the service came to use the value."""
    result = subprocess.run(
        service_command(tiny_table.path, "--address", "127.0.0.1:0", flag, value,
                        entry=CLI_ENTRY),
        cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"backport ple: error: {flag}={value!r}" in result.stderr, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_relative_shm_dir_reaches_engines_as_an_absolute_path(
        tiny_table: TableFile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Describe` gives engines the folder. Given relative to the service's working folder,
    it named another folder (or none) in an engine's, which then used gRPC without a word."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    relative = os.path.relpath(shm_dir, REPO_ROOT)  # the service runs in REPO_ROOT
    with ServiceProcess(tiny_table.path, extra_args=("--shm-dir", relative)) as service:
        monkeypatch.chdir(tmp_path)  # an engine's working folder is not the service's
        client = PleTableClient(service.address)
        try:
            assert client.is_local
            assert client.info.shm_dir == str(shm_dir)
            ids = np.array([[0, 999]])
            assert np.array_equal(client.gather(ids), tiny_table.rows[ids])
        finally:
            client.close()
    assert not (shm_dir / service.shm_name).exists()


def test_the_engines_address_variable_does_not_move_where_the_service_listens(
        tiny_table: TableFile) -> None:
    """Engines read BACKPORT_PLE_ADDRESS as the service they use, and `backport ple` read it
    as its own listen address: run in a shell that exported it for engines (here, another
    machine's service), the service tried to listen there and did not start."""
    engines_service = f"10.255.255.1:{free_port()}"
    with ServiceProcess(tiny_table.path, entry=CLI_ENTRY, listen_by_env=True,
                        extra_env={ADDRESS_ENV: engines_service}) as service:
        client = PleTableClient(service.address)
        try:
            ids = np.array([[0, 999]])
            assert np.array_equal(client.gather(ids), tiny_table.rows[ids])
        finally:
            client.close()


def test_without_its_own_variable_the_service_listens_on_the_default(
        monkeypatch: pytest.MonkeyPatch, tiny_table: TableFile) -> None:
    monkeypatch.setenv(ADDRESS_ENV, "10.255.255.1:50071")
    monkeypatch.delenv(LISTEN_ADDRESS_ENV, raising=False)
    parser = argparse.ArgumentParser()
    PleSettings.add_arguments(parser)
    settings = PleSettings.from_namespace(parser.parse_args(["--table-path", str(tiny_table.path)]))
    assert settings.address == "127.0.0.1:50071"
