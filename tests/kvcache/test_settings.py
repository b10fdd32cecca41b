"""KV service settings -> the `lmcache server` command line, and reclaiming exited engines' segments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.kvcache.server_command import lmcache_server_argv
from services.kvcache.settings import KvCacheSettings, TransferMode
from services.kvcache.shm_segments import (
    lmcache_segment_files,
    mapped_shm_bytes,
    reclaim_exited_engine_segments,
)
from tests.conftest import free_port
from tests.kvcache.processes import REPO_ROOT


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_settings_come_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKPORT_KVCACHE_TRANSFER_MODE", "shm")
    monkeypatch.setenv("BACKPORT_KVCACHE_CHUNK_SIZE_TOKENS", "1152")
    settings = KvCacheSettings()
    assert settings.transfer_mode is TransferMode.SHM and settings.chunk_size_tokens == 1152


def test_argv_carries_every_setting(tmp_path: Path) -> None:
    settings = KvCacheSettings(port=6001, http_port=6002, chunk_size_tokens=1024, l1_size_gib=3,
                               eviction_policy="ARC", transfer_mode="zmq",
                               fs_l2_path=tmp_path, fs_l2_capacity_gib=5,
                               redis_url="redis://user:p%40ss%3Aword@127.0.0.1:6379/0")
    argv = lmcache_server_argv(settings)
    assert argv[1:4] == ["-m", "services.kvcache.lmcache_server", "server"]
    assert flag_values(argv, "--port") == ["6001"] and flag_values(argv, "--http-port") == ["6002"]
    assert flag_values(argv, "--chunk-size") == ["1024"]
    assert flag_values(argv, "--l1-size-gb") == ["3.0"]
    assert flag_values(argv, "--eviction-policy") == ["ARC"]
    assert flag_values(argv, "--supported-transfer-mode") == ["engine_driven"]
    disk, redis = (json.loads(spec) for spec in flag_values(argv, "--l2-adapter"))
    assert disk["type"] == "fs_native" and disk["base_path"] == str(tmp_path)
    assert disk["max_capacity_gb"] == 5 and disk["eviction"]["eviction_policy"] == "LRU"
    # The password as Redis knows it, not as the URL had to spell it.
    assert redis == {"type": "resp", "host": "127.0.0.1", "port": 6379, "username": "user",
                     "password": "p@ss:word", "max_capacity_gb": 4.0, "eviction": disk["eviction"]}


def test_shm_mode_and_no_l2_by_default() -> None:
    argv = lmcache_server_argv(KvCacheSettings(transfer_mode="shm"))
    assert flag_values(argv, "--supported-transfer-mode") == ["lmcache_driven"]
    assert "--l2-adapter" not in argv


@pytest.mark.parametrize("fields", [
    {"redis_url": "localhost:6379"}, {"redis_url": "redis://127.0.0.1:6379/3"},
    {"port": 7000, "http_port": 7000},
    {"transfer_mode": "rdma"}, {"worker_reap_timeout_s": 10}])
def test_invalid_settings_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        KvCacheSettings(**fields)


def test_exited_engine_segments_are_reclaimed_and_live_ones_kept(tmp_path: Path) -> None:
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True)
    dead_pid = int(exited.stdout)
    (tmp_path / f"lmcache_kv_{dead_pid}_0").write_bytes(b"\0" * 4096)
    (tmp_path / f"lmcache_kv_{os.getpid()}_0").write_bytes(b"\0" * 8192)
    (tmp_path / "lmcache_l1_pool_service").write_bytes(b"\0" * 100)
    (tmp_path / "psm_other").write_bytes(b"\0")
    assert {s.path.name for s in lmcache_segment_files(tmp_path)} == {
        f"lmcache_kv_{dead_pid}_0", f"lmcache_kv_{os.getpid()}_0", "lmcache_l1_pool_service"}
    assert reclaim_exited_engine_segments(tmp_path) == 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"lmcache_kv_{os.getpid()}_0", "lmcache_l1_pool_service", "psm_other"])


def test_mapped_shm_bytes_counts_unlinked_mappings() -> None:
    from multiprocessing import shared_memory
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        before = mapped_shm_bytes(os.getpid())
        segment.unlink()
        # Unlinked but still mapped: the pages are still held.
        assert mapped_shm_bytes(os.getpid()) == before >= 1 << 20
    finally:
        segment.close()
    assert mapped_shm_bytes(os.getpid()) == before - (1 << 20)


def run_kv_service(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.kvcache", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("host", ["nosuch.invalid", "192.0.2.1"])
def test_a_host_this_machine_cannot_listen_on_is_refused_as_a_setting(host: str) -> None:
    # 192.0.2.1 (TEST-NET-1) resolves but is no address of this machine.
    finished = run_kv_service("--host", host, "--port", str(free_port()),
                              "--http-port", str(free_port()))
    assert finished.returncode == 2, finished.stderr
    assert f"--host={host!r}" in finished.stderr and "Traceback" not in finished.stderr


def test_missing_lmcache_is_reported_with_what_to_install(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    finished = run_kv_service("--lmcache-python", str(venv / "bin" / "python"),
                              "--port", str(free_port()), "--http-port", str(free_port()))
    assert finished.returncode == 1, finished.stderr
    assert "make kvcache-deps" in finished.stderr and "Traceback" not in finished.stderr


def test_an_l2_path_that_cannot_be_a_directory_is_refused(tmp_path: Path) -> None:
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    with pytest.raises(ValidationError, match="must be a directory"):
        KvCacheSettings(fs_l2_path=in_the_way / "l2")
    assert KvCacheSettings(fs_l2_path=tmp_path / "new" / "l2").fs_l2_path == tmp_path / "new" / "l2"
