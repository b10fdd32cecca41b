"""The KV service's port check: taken means listened on, not a stopped server's TIME_WAIT."""

from __future__ import annotations

import http.server
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from services.mesh.ports import is_port_free
from tests.conftest import free_port
from tests.kvcache.processes import REPO_ROOT, lmcache_python, process_environment, start_kv_service


class _OkHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def test_a_listened_port_is_taken_and_a_stopped_servers_port_is_free() -> None:
    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), _OkHandler)
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    try:
        assert not is_port_free("127.0.0.1", port)
        # The server closes first, so its side of this connection stays in TIME_WAIT.
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).read()
    finally:
        server.shutdown()
        server.server_close()
        serving.join()
    assert is_port_free("127.0.0.1", port)


def test_kv_service_restarts_at_once_on_the_ports_it_left(tmp_path: Path) -> None:
    python = lmcache_python()
    if python is None:
        pytest.skip("lmcache (make kvcache-deps) and vllm are not importable")
    first = start_kv_service(python, tmp_path)
    assert first.stop() == 0, first.log_tail()
    restarted = subprocess.Popen(
        [python, "-m", "services.kvcache", "--port", str(first.port),
         "--http-port", str(first.http_port), "--l1-size-gib", "1"],
        cwd=REPO_ROOT, env=process_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for line in restarted.stdout or ():
            assert b"already in use" not in line, line
            if b"KV cache service ready" in line:
                break
        else:
            pytest.fail(f"KV service exited with {restarted.wait()} before it was ready")
    finally:
        restarted.terminate()
        assert restarted.wait(timeout=60) == 0
