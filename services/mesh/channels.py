"""Client channels and health checks between services."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
KEEPALIVE_TIME_MS = 10_000
# A server's least interval between a client's pings on a connection with no call open; gRPC's
# default, one per 5 min, answers the clients' keepalive with GOAWAY too_many_pings at the third.
# (gRPC core's macro is ..._MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; the name it reads is this.)
MIN_PING_INTERVAL_OPTION = "grpc.http2.min_ping_interval_without_data_ms"

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    (MIN_PING_INTERVAL_OPTION, KEEPALIVE_TIME_MS // 2),
    # An engine restarted at the same address is reached within seconds.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)


async def is_serving(channel: grpc.aio.Channel, timeout_s: float = 2.0, service: str = "") -> bool:
    """`service` names the gRPC service to ask about ("" for the server as a whole). A server
    that does not host it answers NOT_FOUND, which is not serving."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_until_serving(address: str, timeout_s: float, service: str = "") -> bool:
    """Blocking: polls the health service until it answers SERVING for `service` or time runs
    out."""

    async def poll() -> bool:
        deadline = time.monotonic() + timeout_s
        async with open_channel(address) as channel:
            while time.monotonic() < deadline:
                if await is_serving(channel, service=service):
                    return True
                await asyncio.sleep(0.25)
        return False

    return asyncio.run(poll())
