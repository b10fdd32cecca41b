"""The `lmcache server` command line that realises a `KvCacheSettings`."""

from __future__ import annotations

import json
import sys
from urllib.parse import unquote, urlsplit

from services.kvcache.settings import KvCacheSettings, TransferMode

# LMCache's names for the two ways KV moves (its `--supported-transfer-mode`).
LMCACHE_SERVER_TRANSFER_MODES: dict[TransferMode, str] = {
    # Only the message path: an engine asking for the shared-memory path is refused at
    # registration instead of leaving its segment behind.
    TransferMode.ZMQ: "engine_driven",
    TransferMode.SHM: "lmcache_driven",
}

# Fraction of a tier's capacity at which LMCache starts evicting, and how much it frees.
EVICTION_TRIGGER_WATERMARK = 0.8
EVICTION_RATIO = 0.2


def l2_adapter_specs(settings: KvCacheSettings) -> list[dict[str, object]]:
    """LMCache `--l2-adapter` JSON objects: disk first (local, cheapest to read), then Redis."""
    specs: list[dict[str, object]] = []
    eviction = {"eviction_policy": "LRU", "trigger_watermark": EVICTION_TRIGGER_WATERMARK,
                "eviction_ratio": EVICTION_RATIO}
    if settings.fs_l2_path is not None:
        specs.append({"type": "fs_native", "base_path": str(settings.fs_l2_path),
                      "max_capacity_gb": settings.fs_l2_capacity_gib, "eviction": eviction,
                      # Kept on disk at shutdown: a restarted service serves them again.
                      "persist_enabled": True})
    if settings.redis_url is not None:
        url = urlsplit(settings.redis_url)
        # A URL carries its credentials percent-encoded (a password with "@" or ":").
        specs.append({"type": "resp", "host": url.hostname, "port": url.port,
                      "username": unquote(url.username or ""), "password": unquote(url.password or ""),
                      "max_capacity_gb": settings.redis_capacity_gib, "eviction": eviction})
    return specs


def lmcache_server_argv(settings: KvCacheSettings) -> list[str]:
    """The child process's argv: stock `lmcache server` (through `services.kvcache.lmcache_server`,
    which releases shm-mode mappings LMCache 0.5.6 keeps), run by the configured interpreter."""
    python = str(settings.lmcache_python) if settings.lmcache_python else sys.executable
    argv = [
        python, "-m", "services.kvcache.lmcache_server", "server",
        "--host", settings.host, "--port", str(settings.port),
        "--http-host", "127.0.0.1", "--http-port", str(settings.http_port),
        "--chunk-size", str(settings.chunk_size_tokens),
        "--l1-size-gb", str(settings.l1_size_gib),
        "--eviction-policy", settings.eviction_policy,
        "--eviction-trigger-watermark", str(EVICTION_TRIGGER_WATERMARK),
        "--max-workers", str(settings.max_workers),
        "--supported-transfer-mode", LMCACHE_SERVER_TRANSFER_MODES[settings.transfer_mode],
        # Workers heartbeat only once they served a request; a shorter grace for the silent
        # time before that would drop live idle engines, so LMCache's hour stays.
        "--worker-reap-timeout-seconds", str(settings.worker_reap_timeout_s),
    ]
    for spec in l2_adapter_specs(settings):
        argv += ["--l2-adapter", json.dumps(spec, separators=(",", ":"))]
    return argv
