"""Typed settings of the KV-cache service (LMCache's server, supervised)."""

from __future__ import annotations

import os
import socket
from enum import StrEnum
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.mesh.settings import ServiceSettings


class TransferMode(StrEnum):
    """How KV blocks move between an engine and the service.

    `zmq`: the engine copies its blocks into messages over the ZMQ socket (LMCache's
    `engine_driven` mode); works across hosts, nothing is left behind when an engine exits.
    `shm`: the engine's KV cache lives in a /dev/shm segment the server maps and copies
    from itself (LMCache's `lmcache_driven` mode); same host only, and LMCache keeps an
    exited engine's segment, which this service reclaims (see `shm_segments`).
    """

    ZMQ = "zmq"
    SHM = "shm"


class KvCacheSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BACKPORT_KVCACHE_", extra="forbid")

    host: str = Field("127.0.0.1", description="address of LMCache's request (ZMQ) socket")
    port: int = Field(5555, ge=1, le=65535, description="LMCache's request (ZMQ) port")
    http_port: int = Field(5556, ge=1, le=65535,
                           description="LMCache's HTTP port (/healthcheck, /status, /config)")
    transfer_mode: TransferMode = Field(TransferMode.ZMQ, description="zmq | shm")
    chunk_size_tokens: int = Field(
        256, gt=0, description="tokens per stored KV chunk; a multiple of every served "
                               "model's KV block (see services.engine.kv_transfer)")
    l1_size_gib: float = Field(2.0, gt=0, description="host-memory (L1) tier size in GiB")
    eviction_policy: Literal["LRU", "ARC", "noop"] = Field("LRU", description="L1 eviction policy")
    max_workers: int = Field(1, gt=0, description="LMCache transfer worker threads")
    fs_l2_path: Path | None = Field(None, description="directory of the disk (fs_native) L2 tier")
    fs_l2_capacity_gib: float = Field(8.0, gt=0, description="disk L2 bound in GiB (LRU beyond it)")
    redis_url: str | None = Field(None, description="redis://[user:password@]host:port[/0] of a "
                                                    "Redis (resp) L2 tier (LMCache's uses database 0)")
    redis_capacity_gib: float = Field(4.0, gt=0, description="Redis L2 bound in GiB")
    worker_reap_timeout_s: float = Field(
        30.0, ge=30.0, description="LMCache drops an engine silent this long (at least 3 "
                                   "heartbeats of 10 s), unmapping its shared memory")
    shm_reclaim_interval_s: float = Field(
        5.0, gt=0, description="how often segments of exited engines are unlinked")
    startup_timeout_s: float = Field(180.0, gt=0, description="how long LMCache may take to be ready")
    stop_timeout_s: float = Field(20.0, gt=0, description="SIGTERM: how long LMCache may take to stop")
    lmcache_python: Path | None = Field(
        None, description="Python interpreter whose environment holds lmcache "
                          "(default: this one)")

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        # Checked here, by binding as the server will: otherwise a name that does not resolve ends
        # in the resolver's traceback, and another machine's address reads as "port already in use".
        try:
            family, _, _, _, address = socket.getaddrinfo(value, 0, type=socket.SOCK_STREAM)[0]
            with socket.socket(family) as probe:
                probe.bind(address)
        except OSError as error:
            raise ValueError(f"host must be an address of this machine, got {value!r} "
                             f"({error.strerror})") from None
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("redis", "resp") or not parts.hostname or not parts.port:
            raise ValueError(f"redis_url must look like redis://host:port, got {value!r}")
        # LMCache's Redis tier has no database setting: it always uses database 0.
        if parts.path.strip("/") not in ("", "0") or parts.query:
            raise ValueError("redis_url: LMCache's Redis tier uses database 0 and takes no "
                             f"options; got {parts.path + ('?' + parts.query if parts.query else '')!r}")
        return value

    @field_validator("lmcache_python")
    @classmethod
    def _check_lmcache_python(cls, value: Path | None) -> Path | None:
        # Checked here so a wrong path is named as a setting, not met as Popen's traceback.
        if value is not None and not (value.is_file() and os.access(value, os.X_OK)):
            raise ValueError(f"lmcache_python must be an executable Python, got {str(value)!r}")
        return value

    @field_validator("fs_l2_path")
    @classmethod
    def _check_fs_l2_path(cls, value: Path | None) -> Path | None:
        # LMCache creates the directory at its start; a file in the way or a read-only parent
        # would end the server with a C++ filesystem error after seconds of start-up.
        if value is None:
            return None
        existing = next(p for p in (value, *value.parents) if p.exists())
        if not existing.is_dir():
            raise ValueError(f"fs_l2_path must be a directory, but {str(existing)!r} is not one")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"fs_l2_path: {str(existing)!r} is not writable")
        return value

    @model_validator(mode="after")
    def _check_ports(self) -> KvCacheSettings:
        if self.port == self.http_port:
            raise ValueError(f"port and http_port must differ (both {self.port})")
        return self

    @property
    def address(self) -> str:
        """What engines are given as the KV service: host:port of the request socket."""
        return f"{self.host}:{self.port}"
