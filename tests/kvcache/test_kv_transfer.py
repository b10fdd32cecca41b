"""Chunk-size rules per model family and the engine's kv_transfer/kv_events arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.kv_transfer import (
    FAMILY_RULES,
    KvTransferConfigError,
    choose_chunk_size,
    engine_kv_args,
    kv_block_rule,
)
from tests.conftest import REPO_ROOT


def model_folder(tmp_path: Path, **config: object) -> str:
    folder = tmp_path / str(config.get("model_type", "model"))
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(("model_type", "block", "default"), [
    ("deepseek_v4", 1024, 1024), ("glm5_next", 1152, 1152), ("qwen4_exp", 800, 800)])
def test_family_chunks_are_multiples_of_the_family_block(tmp_path: Path, model_type: str,
                                                          block: int, default: int) -> None:
    model = model_folder(tmp_path, model_type=model_type)
    assert choose_chunk_size(model) == default
    assert choose_chunk_size(model, 3 * block) == 3 * block
    with pytest.raises(KvTransferConfigError, match=rf"{block}-token KV block") as refused:
        choose_chunk_size(model, 256)
    message = str(refused.value)
    assert FAMILY_RULES[model_type].family in message and "Use " in message


def test_other_models_follow_vllm_block_size(tmp_path: Path) -> None:
    llama = model_folder(tmp_path, model_type="llama")
    assert choose_chunk_size(llama, is_cpu=True) == 256  # CPU blocks are 128 tokens
    assert choose_chunk_size(llama, block_size_tokens=48, is_cpu=True) == 288
    assert kv_block_rule(llama, is_cpu=False).block_tokens == 16
    with pytest.raises(KvTransferConfigError, match="multiples of its 128-token KV block"):
        choose_chunk_size(llama, 200, is_cpu=True)
    mla = model_folder(tmp_path, model_type="deepseek_v3", kv_lora_rank=512)
    assert kv_block_rule(mla, is_cpu=True).block_tokens == 16


def test_engine_args_for_each_transfer_mode(tmp_path: Path) -> None:
    model = model_folder(tmp_path, model_type="glm5_next")
    zmq = engine_kv_args(model, "127.0.0.1:5555", "zmq", 1152, None)
    assert set(zmq) == {"kv_transfer_config"}
    config = zmq["kv_transfer_config"]
    assert config["kv_connector"] == "LMCacheMPConnector"
    assert config["kv_connector_module_path"] == "lmcache.integration.vllm.lmcache_mp_connector"
    extra = config["kv_connector_extra_config"]
    assert extra["lmcache.mp.host"] == "tcp://127.0.0.1" and extra["lmcache.mp.port"] == 5555
    assert extra["lmcache.mp.mp_transfer_mode"] == "engine_driven"
    shm = engine_kv_args(model, "localhost:5555", "shm", None, "tcp://*:5557")
    assert shm["kv_transfer_config"]["kv_connector_extra_config"]["lmcache.mp.mp_transfer_mode"] \
        == "lmcache_driven"
    assert shm["kv_events_config"] == {"enable_kv_cache_events": True, "publisher": "zmq",
                                       "endpoint": "tcp://*:5557", "topic": "kv-events"}


def test_no_service_means_no_connector(tmp_path: Path) -> None:
    model = model_folder(tmp_path, model_type="llama")
    assert engine_kv_args(model, None, "zmq", None, None) == {}
    assert set(engine_kv_args(model, None, "zmq", None, "tcp://*:5557")) == {"kv_events_config"}


@pytest.mark.parametrize(("service", "mode", "chunk", "error"), [
    ("10.1.2.3:5555", "shm", None, "only a server on this host"),
    ("127.0.0.1:5555", "rdma", None, "unknown KV transfer mode"),
    ("127.0.0.1", "zmq", None, "host:port"),
    ("[::1]:5555", "zmq", None, "IPv6, which LMCache's client cannot reach"),
    ("::1:5555", "zmq", None, "IPv6"),
    ("ipc:///tmp/kv:5555", "zmq", None, "host:port"),
    ("127.0.0.1:5555", "zmq", 1000, "multiples of its 1152-token KV block"),
])
def test_refused_combinations_say_why(tmp_path: Path, service: str, mode: str,
                                      chunk: int | None, error: str) -> None:
    model = model_folder(tmp_path, model_type="glm5_next")
    with pytest.raises(KvTransferConfigError, match=error):
        engine_kv_args(model, service, mode, chunk, None)


def test_missing_model_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KvTransferConfigError, match="no config.json"):
        choose_chunk_size(str(tmp_path))


@pytest.mark.parametrize(("endpoint", "error"), [
    ("tcp://*:0", "port from 1 to 65535"),  # vLLM would bind a port nobody is told
    ("tcp://*:99999", "port from 1 to 65535"),  # ZMQ would bind a random port
    ("tcp://*:abc", "port from 1 to 65535"),
    ("*:5557", "tcp://HOST:PORT or ipc://PATH"),
    ("tcp://[::]:5557", "IPv6, which vLLM's publisher cannot use"),
    ("ipc://", "tcp://HOST:PORT or ipc://PATH"),
    ("ipc:///tmp/" + "k" * 120, "at most 107 bytes"),
    ("ipc:///nonexistent-folder/kv-events", "no folder '/nonexistent-folder'"),
])
def test_refused_kv_events_endpoints_say_why(tmp_path: Path, endpoint: str, error: str) -> None:
    model = model_folder(tmp_path, model_type="llama")
    with pytest.raises(KvTransferConfigError, match=error):
        engine_kv_args(model, None, "zmq", None, endpoint)


@pytest.mark.parametrize(("args", "named"), [
    (["--kv-service", "127.0.0.1:5555", "--kv-transfer-mode", "rdma"],
     "--kv-transfer-mode='rdma': Value error, unknown KV transfer mode"),
    (["--kv-service", "127.0.0.1"], "--kv-service='127.0.0.1'"),
    (["--kv-service", "[::1]:5555"], "--kv-service='[::1]:5555'"),
    (["--kv-events-endpoint", "tcp://*:0"], "--kv-events-endpoint='tcp://*:0'"),
    (["--kv-service", "10.1.2.3:5555", "--kv-transfer-mode", "shm"], "only a server on this host"),
    (["--kv-service", "127.0.0.1:5555", "--kv-chunk-size-tokens", "1000"],
     "multiples of its 1152-token KV block"),
    (["--kv-chunk-size-tokens", "1152"], "--kv-chunk-size-tokens: KV cache service settings"),
])
def test_engine_cli_names_a_bad_kv_setting_without_a_traceback(tmp_path: Path, args: list[str],
                                                               named: str) -> None:
    model = model_folder(tmp_path, model_type="glm5_next")
    finished = subprocess.run(
        [sys.executable, "-m", "services.cli", "engine", "--model", model, "--port", "0", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("BACKPORT_ENGINE_")})
    assert finished.returncode == 2, finished.stderr
    assert "Traceback" not in finished.stderr
    assert named in finished.stderr.splitlines()[-1]
