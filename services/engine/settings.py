from typing import Any, Literal, Self

from pydantic import Field, Json, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.engine.kv_transfer import (
    check_kv_events_endpoint,
    check_kv_service,
    choose_chunk_size,
    parse_transfer_mode,
    split_kv_service_address,
)
from services.mesh.settings import ServiceSettings, check_redis_url


# vLLM's scheduler policies, by their names in vLLM.
SchedulingPolicy = Literal["fcfs", "priority"]


class EngineSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BACKPORT_ENGINE_", extra="forbid")

    model: str = Field(description="local HF model folder")
    served_model_name: str | None = Field(None, description="name clients use (default: folder name)")
    host: str = Field("127.0.0.1", description="address to listen on (loopback unless told otherwise)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 picks a free one)")
    max_model_len: int | None = Field(None, gt=0, description="context length (default: the model's)")
    max_num_seqs: int | None = Field(None, gt=0, description="most sequences scheduled at once")
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs", description="fcfs: in order of arrival | priority: by each request's `priority`, "
                            "lower first, then arrival")
    dtype: str = Field("auto", description="weight and activation dtype")
    enforce_eager: bool = Field(False, description="skip torch.compile and graph capture (faster start)")
    enable_prefix_caching: bool = Field(True, description="vLLM's automatic prefix caching")
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs per engine")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU memory fraction for vLLM")
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="KV cache size in GiB instead of a memory fraction "
                                "(default on CPU: 2 GiB)")
    trust_remote_code: bool = Field(False, description="allow the checkpoint's own model code")
    logits_processors: list[str] = Field(default_factory=list,
                                         description="vLLM logits processor classes, module:Class")
    reasoning_parser: str | None = Field(
        None, description="vLLM's reasoning parser for the model (deepseek_v4 | glm45 | qwen3...): "
                          "it finds where the reasoning ends, so that a constrained output "
                          "(JSON schema, forced tool call) can follow the model's reasoning")
    kv_service: str | None = Field(None, description="KV cache service (LMCache server) host:port")
    kv_transfer_mode: str = Field("zmq", description="KV transfer to the service: zmq or shm")
    kv_chunk_size_tokens: int | None = Field(
        None, gt=0, description="the KV service's chunk size (default: chosen from the model)")
    kv_events_endpoint: str | None = Field(
        None, description="publish vLLM's KV cache events over ZMQ here, e.g. tcp://*:5557")
    drain_timeout_s: float = Field(60.0, ge=0, description="SIGTERM: how long in-flight requests may finish")
    advertise_address: str | None = Field(
        None, description="host:port gateways use to reach this engine (default: host:port)")
    redis_url: str | None = Field(None, description="Redis of the engine registry (off when unset)")
    registry_ttl_s: float = Field(6.0, gt=0, description="lifetime of the registry record; "
                                                          "renewed every third of it")
    metrics_port: int | None = Field(None, ge=0, le=65535,
                                     description="Prometheus /metrics HTTP port (off when unset)")
    # Its default is JSON text too: settings validate their defaults.
    vllm_args: Json[dict[str, Any]] = Field(
        "{}", description="more of vLLM's engine arguments, a JSON object of "
                                          "their Python names, e.g. '{\"max_num_batched_tokens\": 8192}'")

    @field_validator("redis_url")
    @classmethod
    def _redis_url_is_one(cls, value: str | None) -> str | None:
        check_redis_url(value)
        return value

    # The KV settings are checked here, not first at engine start: a bad value then stops the
    # command with one line naming its flag, not a traceback from inside vLLM's startup.
    @field_validator("kv_service")
    @classmethod
    def _kv_service_is_host_port(cls, value: str | None) -> str | None:
        if value is not None:
            split_kv_service_address(value)
        return value

    @field_validator("kv_transfer_mode")
    @classmethod
    def _kv_transfer_mode_is_known(cls, value: str) -> str:
        parse_transfer_mode(value)
        return value

    @field_validator("kv_events_endpoint")
    @classmethod
    def _kv_events_endpoint_is_reachable(cls, value: str | None) -> str | None:
        if value is not None:
            check_kv_events_endpoint(value)
        return value

    @model_validator(mode="after")
    def _kv_transfer_fits_the_model(self) -> Self:
        if self.kv_service is None:
            ignored = {"kv_transfer_mode", "kv_chunk_size_tokens"} & self.model_fields_set
            if ignored:
                flags = " and ".join("--" + name.replace("_", "-") for name in sorted(ignored))
                raise ValueError(f"{flags}: KV cache service settings, used only with --kv-service")
            return self
        check_kv_service(self.kv_service, self.kv_transfer_mode)
        choose_chunk_size(self.model, self.kv_chunk_size_tokens)
        return self
