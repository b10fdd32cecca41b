"""`backport up`: the mesh as separate processes, started in order and stopped without orphans."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.engine.backport.ple.activation import ADDRESS_ENV as PLE_ADDRESS_ENV
from services.engine.kv_transfer import KvTransferConfigError, choose_chunk_size
from services.engine.settings import SchedulingPolicy
from services.gateway.routing import RoutingPolicy
from services.gateway.settings import PASSED_ON_CHECKS, check_passed_on_field
from services.gpu_placement import VISIBLE_DEVICES_ENV, split_gpus, visible_gpus
from services.kvcache.settings import TransferMode
from services.mesh.channels import wait_until_serving
from services.mesh.errors import ServiceStartError
from services.mesh.lifeline import stop_when_parent_is_gone
from services.mesh.ports import is_port_free
from services.mesh.service_names import ENGINE_GRPC, PLE_GRPC, TOKENIZER_GRPC
from services.mesh.settings import ServiceSettings
from services.ple_offload.errors import TableFileError
from services.ple_offload.model_table import ple_table_for_model

logger = logging.getLogger(__name__)

POLL_S = 0.25
KV_CACHE_SERVICE = "kvcache"
PLE_SERVICE = "ple"
GATEWAY_SERVICE = "gateway"
TOKENIZER_SERVICE = "tokenizer"
# Services the mesh serves on without for a while, restarted when they exit once it has come
# up: the gateway reconnects to the tokenizer (a request it was serving fails, 503), engines to
# the PLE service, and engines run without the KV cache until it is back.
RESTARTED_SERVICES = frozenset({TOKENIZER_SERVICE, KV_CACHE_SERVICE, PLE_SERVICE})
# A service that keeps exiting (its port still held, a full disk) is started at most this often.
RESTART_INTERVAL_S = 5.0
# The order services stop in: the gateway first so no new work arrives, then the services
# behind it, the KV and PLE services last, once no engine uses them (the KV service frees
# every engine's segment; engines would wait for a stopped PLE service to come back).
NUM_STOP_TIERS = 3
# The gateway's `api_key` setting as its environment gives it (a JSON list).
GATEWAY_API_KEYS_ENV = "BACKPORT_GATEWAY_API_KEY"
MAX_PORT = 65535
# Hands a started service the fd of its lifeline: the read end of a pipe whose write ends only
# the launcher and the services stopped before it hold. It reads end-of-file once they are all
# gone, however the launcher went (SIGKILL and the OOM killer included).
LIFELINE_FD_ENV = "BACKPORT_LAUNCHER_LIFELINE_FD"


class KvCacheUnavailableError(RuntimeError):
    """`--kv-cache` cannot start its service: LMCache is not installed."""


class UpSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BACKPORT_UP_", extra="forbid")

    model: str = Field(description="local HF model folder (default: the embedded SmolLM2-135M)")
    served_model_name: str | None = Field(None, description="model name for clients")
    host: str = Field("127.0.0.1", description="gateway HTTP address")
    port: int = Field(8000, ge=1, le=65535, description="gateway HTTP port")
    tokenizer_port: int = Field(50052, ge=1, le=65535, description="tokenizer gRPC port")
    engine_port: int = Field(50051, ge=1, le=65535,
                             description="first engine's gRPC port; more engines count up "
                                         "(past the mesh's other ports)")
    max_model_len: int | None = Field(None, gt=0, description="context length")
    max_num_seqs: int | None = Field(None, gt=0, description="most sequences an engine "
                                                          "schedules at once")
    scheduling_policy: SchedulingPolicy = Field("fcfs", description="engines' order of service: "
                                                "fcfs | priority (by each request's `priority`)")
    enforce_eager: bool = Field(False, description="engines skip torch.compile (faster start)")
    tool_call_parser: str | None = Field(None, description="deepseek_v4 | glm47 | qwen3_xml")
    reasoning_parser: str | None = Field(None, description="deepseek_v4 | glm45 | qwen3")
    startup_timeout_s: float = Field(900.0, gt=0, description="how long each service may take to start")
    drain_timeout_s: float = Field(60.0, ge=0, description="SIGTERM: how long the gateway's open "
                                                           "requests, then the engines', may finish")
    stop_timeout_s: float = Field(30.0, ge=0, description="SIGTERM: how long a stopping service may "
                                                          "take beyond its drain (vLLM's own "
                                                          "shutdown) before it is killed")
    engines: int = Field(1, ge=1, description="how many engines to start on this machine")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine; each engine gets "
                                                           "its own GPUs")
    redis_url: str | None = Field(None, description="Redis of the engine registry and sessions; "
                                                    "without it the gateway gets a static engine list")
    routing_policy: RoutingPolicy | None = Field(None, description="prefix | session | "
                                                 "least_loaded | round_robin")
    kv_cache_memory_gib: float | None = Field(None, gt=0, description="KV cache per engine in GiB")
    engine_metrics_port: int | None = Field(None, ge=1, le=65535,
                                            description="first engine's Prometheus port; more "
                                                        "engines count up (past the mesh's "
                                                        "other ports)")
    api_key: list[str] = Field(default_factory=list, description="accepted API key")
    api_keys_file: str | None = Field(None, description="file of accepted API keys, one a line")
    allowed_origin: list[str] = Field(default_factory=list,
                                      description="browser origin allowed to call the API (CORS; "
                                                  "`*` for any)")
    kv_cache: bool = Field(False, description="start the KV cache service (LMCache) first and "
                                              "wire every engine to it")
    kv_cache_port: int = Field(5555, ge=1, le=65535, description="KV cache service's request port")
    kv_cache_http_port: int = Field(5556, ge=1, le=65535,
                                    description="KV cache service's HTTP port (/healthcheck)")
    kv_transfer_mode: TransferMode = Field(TransferMode.ZMQ, description="zmq | shm")
    kv_chunk_size_tokens: int | None = Field(
        None, gt=0, description="KV cache service's chunk size (default: chosen from the model)")
    kv_events: bool = Field(False, description="engines publish vLLM's KV cache events, served "
                                               "to routers by their WatchKvEvents gRPC stream")
    ple_table_path: Path | None = Field(
        None, description="PLE table of a Qwen4Exp model (default: the one in its checkpoint), "
                          "served to every engine by a PLE service started first")
    ple_port: int = Field(50071, ge=1, le=65535, description="PLE service's gRPC port")

    # The gateway starts last, once the engines have loaded: what it would refuse is refused
    # now, before anything starts.
    _gateway_takes_it = field_validator(*PASSED_ON_CHECKS)(check_passed_on_field)


@dataclass
class ServiceProcess:
    name: str
    command: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...]
    process: subprocess.Popen[bytes]
    started_at: float

    @classmethod
    def start(cls, name: str, command: list[str], env: dict[str, str],
              pass_fds: tuple[int, ...]) -> ServiceProcess:
        return cls(name, command, env, pass_fds, cls._popen(command, env, pass_fds),
                   time.monotonic())

    def restart(self) -> None:
        self.process = self._popen(self.command, self.env, self.pass_fds)
        self.started_at = time.monotonic()

    @staticmethod
    def _popen(command: list[str], env: dict[str, str],
               pass_fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
        # Its own session: Ctrl-C in a terminal reaches the launcher only, which stops the
        # services in order, and a service's group can be killed whole.
        return subprocess.Popen(command, start_new_session=True, env=env, pass_fds=pass_fds)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> None:
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time; killing it", self.name)
        # Each service leads its own process group: this also ends anything it spawned
        # (vLLM's engine-core and worker processes) that outlived it.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def stop_leftovers(self) -> None:
        """Once the service has exited: SIGTERM to what it spawned in its group. vLLM's
        engine core and workers outlive an engine killed outright, holding the model's memory."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def stop_tier(name: str) -> int:
    """When the service called `name` stops, counted from 0 (NUM_STOP_TIERS says why)."""
    if name == GATEWAY_SERVICE:
        return 0
    if name in (KV_CACHE_SERVICE, PLE_SERVICE):
        return 2
    return 1


def count_up(first: int, count: int, taken: set[int]) -> list[int]:
    """`first`, then the next `count - 1` ports above it not in `taken`: by default the second
    engine would count into the tokenizer's port."""
    ports = [first]
    candidate = first
    while len(ports) < count:
        candidate += 1
        if candidate not in taken:
            ports.append(candidate)
    return ports


def stop_with_launcher() -> None:
    """In a service `backport up` started: SIGTERM this process once the launcher is gone, so
    that it drains and frees what it holds (shared memory, ports, the GPU) when the launcher
    was killed outright and could stop nothing itself."""
    stop_when_parent_is_gone(LIFELINE_FD_ENV, "backport up")


class Mesh:
    def __init__(self, settings: UpSettings) -> None:
        self.settings = settings
        # Found before the ports are planned: the PLE service's port is one of the mesh's.
        self._ple_table = ple_table_for_model(Path(settings.model), settings.ple_table_path)
        self.services: list[ServiceProcess] = []
        # (read end, write end) per stop tier. A service reads its tier's and holds the later
        # tiers' write ends, so with the launcher gone the tiers still stop in order.
        self._lifelines = [os.pipe() for _ in range(NUM_STOP_TIERS)]
        self._stop_requested = False
        self._is_ready = False
        # From the moment every engine served, losing one is losing it while serving: the
        # gateway may answer /health (and clients arrive) before `_is_ready` is set.
        self._engines_served = False
        self._lost_engines: set[str] = set()
        # The KV service's chunk size, once it is started; engines are given the same.
        self._kv_chunk_size_tokens: int | None = None
        # The PLE service's address, once it serves; engines are pointed at it.
        self._ple_address: str | None = None
        self._single_ports = self._plan_single_ports()
        single_port_numbers = {port for _, _, port in self._single_ports}
        self._engine_ports = count_up(settings.engine_port, settings.engines, single_port_numbers)
        self._engine_metrics_ports = (
            [] if settings.engine_metrics_port is None else
            count_up(settings.engine_metrics_port, settings.engines,
                     single_port_numbers | set(self._engine_ports)))

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> ServiceProcess:
        command = [sys.executable, "-m", "services.cli", *args]
        tier = stop_tier(name)
        reader = self._lifelines[tier][0]
        later_writers = [writer for _, writer in self._lifelines[tier + 1:]]
        env = dict(os.environ if env is None else env, **{LIFELINE_FD_ENV: str(reader)})
        logger.info("starting %s", name)
        service = ServiceProcess.start(name, command, env, (reader, *later_writers))
        self.services.append(service)
        return service

    def start(self) -> None:
        s = self.settings
        self._refuse_taken_ports()
        engine_gpus = split_gpus(visible_gpus(os.environ), s.engines, s.tensor_parallel_size)
        tokenizer_address = f"127.0.0.1:{s.tokenizer_port}"
        engine_addresses = [f"127.0.0.1:{port}" for port in self._engine_ports]
        if s.kv_cache:
            self._start_kv_cache()
        self._start_ple()
        self._spawn(TOKENIZER_SERVICE, ["tokenizer", "--model", s.model, "--port", str(s.tokenizer_port)])
        for index in range(s.engines):
            self._spawn(self._engine_name(index), self._engine_args(index),
                        self._engine_env(None if engine_gpus is None else engine_gpus[index]))
        self._wait_grpc(TOKENIZER_SERVICE, tokenizer_address, TOKENIZER_GRPC)
        for index, address in enumerate(engine_addresses):
            self._wait_grpc(self._engine_name(index), address, ENGINE_GRPC)
        self._engines_served = True
        gateway_args = ["gateway", "--host", s.host, "--port", str(s.port),
                        "--tokenizer", tokenizer_address, "--drain-timeout-s", str(s.drain_timeout_s)]
        if s.redis_url:
            gateway_args += ["--redis-url", s.redis_url]  # engines arrive through the registry
        else:
            for address in engine_addresses:
                gateway_args += ["--engine", address]
        for flag, value in (("--tool-call-parser", s.tool_call_parser),
                            ("--reasoning-parser", s.reasoning_parser),
                            ("--routing-policy", s.routing_policy),
                            ("--api-keys-file", s.api_keys_file)):
            if value:
                gateway_args += [flag, value]
        for origin in s.allowed_origin:
            gateway_args += ["--allowed-origin", origin]
        gateway_env = None
        if s.api_key:
            # In its environment, not on its command line, which any user of the machine may
            # read (`ps`, /proc/PID/cmdline); it is the gateway's own setting, so it wins.
            gateway_env = dict(os.environ, **{GATEWAY_API_KEYS_ENV: json.dumps(s.api_key)})
        self._spawn(GATEWAY_SERVICE, gateway_args, gateway_env)
        self._wait_http("gateway", f"http://{s.host}:{s.port}/health")
        self._is_ready = True
        logger.info("mesh ready: http://%s:%d/v1 (%d engine(s))", s.host, s.port, s.engines)

    def _plan_single_ports(self) -> list[tuple[str, str, int]]:
        """(flag, host, port) of the services that listen on one port each."""
        s = self.settings
        ports = [("--port", s.host, s.port), ("--tokenizer-port", "127.0.0.1", s.tokenizer_port)]
        if s.kv_cache:
            ports += [("--kv-cache-port", "127.0.0.1", s.kv_cache_port),
                      ("--kv-cache-http-port", "127.0.0.1", s.kv_cache_http_port)]
        if self._ple_table is not None:
            ports.append(("--ple-port", "127.0.0.1", s.ple_port))
        return ports

    def _refuse_taken_ports(self) -> None:
        """Before anything starts: a server already on one of these ports (another of the
        mesh's own included) would answer the health checks in place of the service started
        there, and one child failing to bind would only show once the engines had loaded."""
        host = self.settings.host
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            raise ServiceStartError(f"--host {host}: {error.strerror}") from None
        ports = [*self._single_ports,
                 *(("--engine-port", "127.0.0.1", port) for port in self._engine_ports),
                 *(("--engine-metrics-port", "127.0.0.1", port)
                   for port in self._engine_metrics_ports)]
        flag_of_port: dict[int, str] = {}
        for flag, _, port in ports:
            if port > MAX_PORT:
                raise ServiceStartError(f"--engines {self.settings.engines} count {flag} past port "
                                        f"{MAX_PORT}; choose a lower {flag}")
            if port in flag_of_port:
                raise ServiceStartError(f"port {port} is given to both {flag_of_port[port]} and "
                                        f"{flag}; choose another")
            flag_of_port[port] = flag
        taken = [f"{port} ({flag})" for flag, host, port in ports if not is_port_free(host, port)]
        if taken:
            raise ServiceStartError(f"port(s) already in use: {', '.join(taken)}; stop what "
                                    "listens there or choose other ports")

    def _start_kv_cache(self) -> None:
        """Engines register with the KV service as they load, so it must answer first."""
        s = self.settings
        if importlib.util.find_spec("lmcache") is None:
            raise KvCacheUnavailableError(
                "--kv-cache needs LMCache in this environment: run `make kvcache-deps` "
                "(pip install --no-deps lmcache==0.5.6 and its few modules; docs/kvcache.md)")
        # Checked against the model's KV block here, so a wrong size fails before anything starts.
        self._kv_chunk_size_tokens = choose_chunk_size(s.model, s.kv_chunk_size_tokens)
        self._spawn(KV_CACHE_SERVICE, [
            "kvcache", "--port", str(s.kv_cache_port), "--http-port", str(s.kv_cache_http_port),
            "--transfer-mode", s.kv_transfer_mode.value,
            "--chunk-size-tokens", str(self._kv_chunk_size_tokens)])
        self._wait_http(KV_CACHE_SERVICE, f"http://127.0.0.1:{s.kv_cache_http_port}/healthcheck")
        logger.info("%s ready at 127.0.0.1:%d", KV_CACHE_SERVICE, s.kv_cache_port)

    def _start_ple(self) -> None:
        """A Qwen4Exp model's engines read their PLE table from this service, so it serves
        (table loaded and checked) before they start."""
        s = self.settings
        table = self._ple_table
        if table is None:
            return
        address = f"127.0.0.1:{s.ple_port}"
        # A segment name per port, so two meshes on one machine never replace each other's table.
        args = ["ple", "--table-path", str(table.table_path), "--address", address,
                "--shm-name", f"backport-ple-{s.ple_port}"]
        if table.tensor_name:
            args += ["--tensor-name", table.tensor_name]
        self._spawn(PLE_SERVICE, args)
        self._wait_grpc(PLE_SERVICE, address, PLE_GRPC)
        self._ple_address = address

    def _engine_env(self, gpus: list[str] | None) -> dict[str, str]:
        """The engine's environment: its GPUs, and the PLE service's address, which the PLE
        hook in vLLM's plugin reads (as do the engine-core and worker processes vLLM spawns)."""
        env = dict(os.environ)
        if gpus is not None:
            env[VISIBLE_DEVICES_ENV] = ",".join(gpus)
        if self._ple_address is not None:
            env[PLE_ADDRESS_ENV] = self._ple_address
        return env

    def _engine_name(self, index: int) -> str:
        return "engine" if self.settings.engines == 1 else f"engine-{index}"

    def _engine_args(self, index: int) -> list[str]:
        s = self.settings
        args = ["engine", "--model", s.model, "--port", str(self._engine_ports[index]),
                "--drain-timeout-s", str(s.drain_timeout_s)]
        if s.served_model_name:
            args += ["--served-model-name", s.served_model_name]
        if s.max_model_len:
            args += ["--max-model-len", str(s.max_model_len)]
        if s.max_num_seqs:
            args += ["--max-num-seqs", str(s.max_num_seqs)]
        args += ["--scheduling-policy", s.scheduling_policy]
        if s.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
        if s.enforce_eager:
            args.append("--enforce-eager")
        if s.kv_cache_memory_gib:
            args += ["--kv-cache-memory-gib", str(s.kv_cache_memory_gib)]
        if s.reasoning_parser:
            # The engine finds where the reasoning ends, for constrained outputs that follow it.
            args += ["--reasoning-parser", s.reasoning_parser]
        if s.redis_url:
            args += ["--redis-url", s.redis_url]
        if self._engine_metrics_ports:
            args += ["--metrics-port", str(self._engine_metrics_ports[index])]
        if s.kv_events:
            args += ["--kv-events-endpoint", f"ipc://{self._kv_events_socket(index)}"]
        if self._kv_chunk_size_tokens is not None:
            args += ["--kv-service", f"127.0.0.1:{s.kv_cache_port}",
                     "--kv-transfer-mode", s.kv_transfer_mode.value,
                     "--kv-chunk-size-tokens", str(self._kv_chunk_size_tokens)]
        return args

    def _kv_events_socket(self, index: int) -> Path:
        """A local socket file: nothing but this host's engine service needs to subscribe."""
        port = self._engine_ports[index]
        return Path(tempfile.gettempdir()) / f"backport-kv-events-{port}"

    def _wait_grpc(self, name: str, address: str, grpc_service: str) -> None:
        """Health is asked of the service the port should hold: a server of another service
        there (the tokenizer on an engine's port, say) answers NOT_FOUND, not SERVING."""
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if wait_until_serving(address, timeout_s=2.0, service=grpc_service):
                logger.info("%s ready at %s", name, address)
                return
        raise TimeoutError(f"{name} did not become healthy within {self.settings.startup_timeout_s} s")

    def _wait_http(self, name: str, url: str) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(url, timeout=2.0) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(POLL_S)
        raise TimeoutError(f"{name} did not become healthy within {self.settings.startup_timeout_s} s")

    def _check_alive(self) -> None:
        if self._stop_requested:
            raise InterruptedError("stop requested")
        for service in self.services:
            if service.process.poll() is None:
                continue
            if self._is_engine(service) and self._engines_served and self._num_engines_alive():
                # The gateway routes around a lost engine; the mesh serves on with the others.
                if service.name not in self._lost_engines:
                    self._lost_engines.add(service.name)
                    service.stop_leftovers()
                    logger.error("%s exited with status %s; %d engine(s) still serve", service.name,
                                 service.process.returncode, self._num_engines_alive())
                continue
            if service.name in RESTARTED_SERVICES and self._engines_served:
                self._restart(service)
                continue
            if service.name == GATEWAY_SERVICE and service.process.returncode == 0 and self._is_ready:
                raise InterruptedError("the gateway drained and stopped")
            raise RuntimeError(f"{service.name} exited with status {service.process.returncode}")

    def _restart(self, service: ServiceProcess) -> None:
        if time.monotonic() < service.started_at + RESTART_INTERVAL_S:
            return
        # What it spawned (LMCache's server) would hold the port the new one must take.
        service.stop_leftovers()
        logger.error("%s exited with status %s; restarting it", service.name,
                     service.process.returncode)
        service.restart()

    def _is_engine(self, service: ServiceProcess) -> bool:
        return service.name.startswith("engine")

    def _num_engines_alive(self) -> int:
        return sum(1 for s in self.services if self._is_engine(s) and s.process.poll() is None)

    def request_stop(self, *_: object) -> None:
        if self._stop_requested:
            # A second Ctrl-C or SIGTERM: the services' second signal, on which the gateway
            # stops at once rather than finish its drain.
            for service in self.services:
                service.stop()
        self._stop_requested = True

    def wait(self) -> None:
        while not self._stop_requested:
            self._check_alive()
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Tier by tier (`stop_tier`), the services of one tier together."""
        for tier in range(NUM_STOP_TIERS):
            group = [s for s in self.services if stop_tier(s.name) == tier]
            for service in group:
                service.stop()
            # The whole drain first: killed sooner, the gateway cuts the streams it is finishing.
            deadline = (time.monotonic() + self.settings.drain_timeout_s
                        + self.settings.stop_timeout_s)
            for service in group:
                service.wait_stopped(deadline)
        if self.settings.kv_events:
            # An engine removes its KV-event socket as it stops; one killed outright cannot.
            for index in range(self.settings.engines):
                self._kv_events_socket(index).unlink(missing_ok=True)
        for reader, writer in self._lifelines:  # every service has stopped: nothing reads them
            os.close(reader)
            os.close(writer)
        self._lifelines = []
        logger.info("mesh stopped")


def run_mesh(settings: UpSettings) -> int:
    try:
        mesh = Mesh(settings)
    except TableFileError as error:
        logger.error("%s", error)
        return 1
    signal.signal(signal.SIGTERM, mesh.request_stop)
    signal.signal(signal.SIGINT, mesh.request_stop)
    try:
        mesh.start()
        mesh.wait()
        return 0
    except InterruptedError:
        return 0
    except (RuntimeError, TimeoutError, KvTransferConfigError, TableFileError) as error:
        logger.error("%s", error)
        return 1
    finally:
        mesh.stop()
