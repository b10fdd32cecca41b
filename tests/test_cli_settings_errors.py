"""A bad flag or environment value stops a `backport` command with one line naming it."""

from __future__ import annotations

import os
import subprocess
import sys

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
    (["-m", "services.ple_offload", "--grace-s", "soon"], {},
     "--table-path (or BACKPORT_PLE_TABLE_PATH) is required; --grace-s='soon'"),
])
def test_invalid_setting_is_named_without_a_traceback(args: list[str], env: dict[str, str],
                                                      named: str) -> None:
    finished = run_cli(*args, env=env)
    assert finished.returncode == 2, finished.stderr
    assert "Traceback" not in finished.stderr
    assert "error: " in finished.stderr and named in finished.stderr.splitlines()[-1]
