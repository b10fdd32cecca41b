"""The tests' port picker: what the mesh and cluster fixtures rely on to start services."""

from __future__ import annotations

import socket

from tests.conftest import ephemeral_port_floor, free_port


def test_free_ports_sit_below_the_ephemeral_range_and_never_repeat() -> None:
    floor = ephemeral_port_floor()
    bases = [free_port(3) for _ in range(100)]
    handed_out = [base + i for base in bases for i in range(3)]
    assert len(set(handed_out)) == len(handed_out)
    assert all(port < floor for port in handed_out)
    # A port the kernel gives an outgoing connection comes from the ephemeral range.
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            assert client.getsockname()[1] >= floor
    for port in handed_out[:30]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
