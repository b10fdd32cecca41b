"""The mesh's gRPC servers take its clients' keepalive pings on idle connections. The server
option that allows them had a name gRPC does not read: a server kept its default of one ping in
5 minutes and dropped an idle connection at the clients' third ping (30 s), GOAWAY
too_many_pings, and a call made as it closed could fail.

Scaled down in time: the server allows a ping a second, the client pings every 1.5 s; an
option gRPC ignored would drop the connection at 4.5 s."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from services.mesh.channels import GRPC_OPTIONS, MIN_PING_INTERVAL_OPTION, is_serving
from services.mesh.grpc_server import SERVER_OPTIONS

SERVER_PING_INTERVAL_MS = 1_000
CLIENT_PING_INTERVAL_MS = 1_500
WATCHED_S = 8.0


def _with(options: list[tuple[str, object]], name: str, value: int) -> list[tuple[str, object]]:
    assert name in dict(options), name
    return [(key, value if key == name else held) for key, held in options]


def test_an_idle_connection_outlives_the_clients_keepalive_pings() -> None:
    async def states_while_idle() -> set[grpc.ChannelConnectivity]:
        server = grpc.aio.server(options=_with(SERVER_OPTIONS, MIN_PING_INTERVAL_OPTION,
                                               SERVER_PING_INTERVAL_MS))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_with(
            GRPC_OPTIONS, "grpc.keepalive_time_ms", CLIENT_PING_INTERVAL_MS))
        try:
            assert await is_serving(channel)
            seen = set()
            deadline = time.monotonic() + WATCHED_S
            while time.monotonic() < deadline:
                seen.add(channel.get_state())
                await asyncio.sleep(0.05)
            return seen
        finally:
            await channel.close()
            await server.stop(None)

    assert asyncio.run(states_while_idle()) == {grpc.ChannelConnectivity.READY}
