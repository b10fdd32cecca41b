"""The engine's side of the KV-cache service: vLLM's `kv_transfer_config` and `kv_events_config`.

LMCache stores KV in chunks of `chunk_size` tokens, and every chunk must cover whole KV
blocks of the model, or the blocks it writes back belong to other tokens. The block a
model needs is its family's (DeepSeek-V4, GLM-5.3, Qwen3.8-Flash-Next, below), else
vLLM's block size on this platform.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.kvcache.settings import TransferMode

LMCACHE_CONNECTOR = "LMCacheMPConnector"
LMCACHE_CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"
# LMCache's connector names for the two transfer modes (`lmcache.mp.mp_transfer_mode`).
CONNECTOR_TRANSFER_MODES: dict[TransferMode, str] = {
    TransferMode.ZMQ: "engine_driven",
    TransferMode.SHM: "lmcache_driven",
}
KV_EVENTS_TOPIC = "kv-events"
# ZMQ's limit on an ipc:// path: sizeof(sockaddr_un.sun_path) - 1.
IPC_PATH_MAX_BYTES = 107
_HOSTNAME = re.compile(r"[A-Za-z0-9_.-]+")
# LMCache's connector waits 300 s by default for the service at engine start; a missing
# service should fail the engine's start sooner than that.
SERVICE_TIMEOUT_S = 60.0
# LMCache's default chunk; chosen chunks are the smallest block multiple at least this long.
PREFERRED_MIN_CHUNK_TOKENS = 256


@dataclass(frozen=True, slots=True)
class KvBlockRule:
    """Tokens one LMCache chunk must be a multiple of, and the chunk chosen by default."""

    family: str
    block_tokens: int
    default_chunk_tokens: int


# Keyed by the checkpoint's `model_type`. DeepSeek-V4's vLLM block is 256 tokens, but only
# 1024-token chunks were shown to round-trip its compressed layers (ratios 4 and 128).
FAMILY_RULES: dict[str, KvBlockRule] = {
    "deepseek_v4": KvBlockRule("DeepSeek-V4", 1024, 1024),
    "glm5_next": KvBlockRule("GLM-5.3", 1152, 1152),
    "qwen4_exp": KvBlockRule("Qwen3.8-Flash-Next", 800, 800),
}
# vLLM's default block sizes when the engine sets none (vllm/platforms/cpu.py, config/cache.py).
CPU_BLOCK_TOKENS = 128
CPU_MLA_BLOCK_TOKENS = 16
GPU_BLOCK_TOKENS = 16


class KvTransferConfigError(ValueError):
    """The engine and KV-service settings would corrupt or lose cached KV; says which and why."""


def kv_block_rule(model_path: str, block_size_tokens: int | None = None,
                  is_cpu: bool | None = None) -> KvBlockRule:
    """The chunk rule for the checkpoint at `model_path` (reads only its config.json)."""
    config = _read_model_config(model_path)
    model_type = str(config.get("model_type", ""))
    if model_type in FAMILY_RULES:
        return FAMILY_RULES[model_type]
    if block_size_tokens is None:
        block_size_tokens = _default_block_tokens(config, _platform_is_cpu() if is_cpu is None
                                                  else is_cpu)
    chunk = math.ceil(PREFERRED_MIN_CHUNK_TOKENS / block_size_tokens) * block_size_tokens
    return KvBlockRule(model_type or "unknown", block_size_tokens, chunk)


def choose_chunk_size(model_path: str, requested_tokens: int | None = None,
                      block_size_tokens: int | None = None, is_cpu: bool | None = None) -> int:
    """The KV service's chunk size for this model: `requested_tokens` checked, or the default."""
    rule = kv_block_rule(model_path, block_size_tokens, is_cpu)
    if requested_tokens is None:
        return rule.default_chunk_tokens
    if requested_tokens <= 0 or requested_tokens % rule.block_tokens:
        lower = max(rule.block_tokens, requested_tokens // rule.block_tokens * rule.block_tokens)
        raise KvTransferConfigError(
            f"KV chunk size {requested_tokens} does not fit {rule.family} "
            f"({Path(model_path).name}): chunks must be whole multiples of its "
            f"{rule.block_tokens}-token KV block, or LMCache stores and restores blocks "
            f"of other tokens. Use {lower} or {lower + rule.block_tokens} "
            f"(default {rule.default_chunk_tokens}).")
    return requested_tokens


def engine_kv_args(model_path: str, kv_service: str | None, transfer_mode: str,
                   chunk_size: int | None, kv_events_endpoint: str | None,
                   block_size_tokens: int | None = None) -> dict[str, Any]:
    """Extra `AsyncEngineArgs` keyword arguments wiring an engine to the KV service.

    `kv_service` is the service's `host:port` (None: no service). `chunk_size` is the
    service's chunk size, checked against the model here so a mismatch fails before the
    engine loads; LMCache's own check would only fire inside the engine's worker.
    `kv_events_endpoint` (e.g. `tcp://*:5557`) turns on vLLM's ZMQ KV-event publisher.
    """
    args: dict[str, Any] = {}
    if kv_service is not None:
        mode = check_kv_service(kv_service, transfer_mode)
        host, port = split_kv_service_address(kv_service)
        choose_chunk_size(model_path, chunk_size, block_size_tokens)
        args["kv_transfer_config"] = {
            "kv_connector": LMCACHE_CONNECTOR,
            "kv_connector_module_path": LMCACHE_CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": f"tcp://{host}",
                "lmcache.mp.port": port,
                "lmcache.mp.mp_transfer_mode": CONNECTOR_TRANSFER_MODES[mode],
                "lmcache.mp.mq_timeout": SERVICE_TIMEOUT_S,
            },
        }
    if kv_events_endpoint is not None:
        check_kv_events_endpoint(kv_events_endpoint)
        args["kv_events_config"] = {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": kv_events_endpoint, "topic": KV_EVENTS_TOPIC,
        }
    return args


def check_kv_service(kv_service: str, transfer_mode: str) -> TransferMode:
    """The transfer mode, once it and the service's address are known to work together."""
    mode = parse_transfer_mode(transfer_mode)
    host, _port = split_kv_service_address(kv_service)
    if mode is TransferMode.SHM and not _is_loopback(host):
        raise KvTransferConfigError(
            f"transfer mode 'shm' shares the engine's KV memory through /dev/shm, which "
            f"only a server on this host can map; {kv_service} is not a loopback "
            f"address. Use transfer mode 'zmq' for a remote KV service.")
    return mode


def parse_transfer_mode(value: str) -> TransferMode:
    try:
        return TransferMode(value)
    except ValueError:
        choices = ", ".join(m.value for m in TransferMode)
        raise KvTransferConfigError(f"unknown KV transfer mode {value!r}; one of: {choices}") from None


def split_kv_service_address(address: str) -> tuple[str, int]:
    """(host, port) of the KV service's `host:port`, as LMCache's connector can reach it."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvTransferConfigError(f"KV service address must be host:port, got {address!r}")
    if _is_ipv6(host):
        # LMCache's ZMQ client never sets ZMQ_IPV6, so it waits out its timeout on any IPv6 peer.
        raise KvTransferConfigError(
            f"KV service address {address!r} is IPv6, which LMCache's client cannot reach; "
            f"use an IPv4 address or a host name")
    if not _HOSTNAME.fullmatch(host):
        raise KvTransferConfigError(f"KV service address must be host:port, got {address!r}")
    return host, int(port)


def check_kv_events_endpoint(endpoint: str) -> None:
    """Refuses an endpoint vLLM's publisher cannot bind, or binds where nobody can find it."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme == "ipc" and rest:
        if len(rest.encode()) > IPC_PATH_MAX_BYTES:
            raise KvTransferConfigError(
                f"KV events endpoint {endpoint!r}: an ipc path may have at most "
                f"{IPC_PATH_MAX_BYTES} bytes (a socket address's limit)")
        if not Path(rest).parent.is_dir():
            raise KvTransferConfigError(
                f"KV events endpoint {endpoint!r}: no folder {str(Path(rest).parent)!r} to hold "
                f"its socket file")
        return
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not host:
        raise KvTransferConfigError(
            f"KV events endpoint must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    # Port 0 makes vLLM bind a port of its choosing, which it tells no subscriber; ZMQ itself
    # turns a port past 65535 into a random one.
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise KvTransferConfigError(
            f"KV events endpoint {endpoint!r} needs a port from 1 to 65535")
    if _is_ipv6(host):
        # vLLM's publisher sets ZMQ_IPV6 only for tcp://*:0, so its bind or connect fails.
        raise KvTransferConfigError(
            f"KV events endpoint {endpoint!r} is IPv6, which vLLM's publisher cannot use; "
            f"use tcp://*:PORT or ipc://PATH")


def _is_ipv6(host: str) -> bool:
    """Whether `host`, bracketed as in a URL or not, is an IPv6 address."""
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).version == 6
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_model_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KvTransferConfigError(f"no config.json in {model_path}: the KV chunk size "
                                    "depends on the model's KV block") from None


def _default_block_tokens(config: dict[str, Any], is_cpu: bool) -> int:
    if not is_cpu:
        return GPU_BLOCK_TOKENS
    # vLLM's CPU MLA kernel only runs with 16-token blocks (MLA models carry kv_lora_rank).
    return CPU_MLA_BLOCK_TOKENS if config.get("kv_lora_rank") else CPU_BLOCK_TOKENS


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform
    return current_platform.is_cpu()
