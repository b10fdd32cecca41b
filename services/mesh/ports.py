"""Whether a service could listen on a port: checked before a slow start, not found out after it."""

from __future__ import annotations

import socket


def is_port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now. The probe binds as servers do (uvicorn,
    gRPC and ZMQ set SO_REUSEADDR): the connections a just-stopped server left in TIME_WAIT
    must not count, or a restart within a minute would be refused."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
