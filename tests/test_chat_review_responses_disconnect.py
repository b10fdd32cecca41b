"""A Responses stream whose client leaves while the opening events are being written ends its
engine request at once, as a chat or completions stream does.

`response.created` and `response.in_progress` echo the request's tools. With a large tool and a
client that reads nothing, the gateway is still writing them (its socket's buffers full) when the
client goes: the stream then ends before a single delta was read.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from urllib.parse import urlsplit

from tests.cluster.processes import engine_num_running
from tests.conftest import RunningMesh

MODEL = "SmolLM2-135M-Instruct-bf16"
# `response.created` alone is then well past what the sockets hold (the kernel grows a loopback
# socket's send buffer up to 4 MiB) and the server's write buffer: the gateway waits to write
# `response.in_progress`.
TOOL_DESCRIPTION_CHARS = 8_000_000


def _wait_for_num_running(engine_address: str, expected: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while engine_num_running(engine_address) != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_client_gone_during_the_opening_events_aborts_the_engine_request(mesh: RunningMesh) -> None:
    tool = {"type": "function", "name": "lookup", "description": "x" * TOOL_DESCRIPTION_CHARS,
            "parameters": {"type": "object", "properties": {}}}
    body = json.dumps({"model": MODEL, "input": "Count from 1 to 1000, one number a line.",
                       "temperature": 0, "max_output_tokens": 1500, "stream": True,
                       "tools": [tool]}).encode()
    address = urlsplit(mesh.base_url)
    head = (f"POST /v1/responses HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.socket() as client:
        # A small receive window: the gateway's writes back up after a few kilobytes.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((address.hostname, address.port))
        client.sendall(head + body)
        assert _wait_for_num_running(mesh.engine_address, 1, timeout_s=60), "the request never ran"
        time.sleep(0.5)  # the gateway has written what the buffers take, and waits
        # Leave with a reset, as a client killed outright does.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert _wait_for_num_running(mesh.engine_address, 0, timeout_s=2.0), \
        "the engine still runs the abandoned response's request after 2 s"
