from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import SettingsConfigDict

from services.gateway.auth import read_keys_file
from services.gateway.parsing.registry import reasoning_format, tool_call_format
from services.gateway.routing import RoutingPolicy
from services.mesh.settings import ServiceSettings, check_redis_url

DEFAULT_ENGINE = "127.0.0.1:50051"


def _check_tool_call_parser(name: str | None) -> None:
    # Checked at start: an unknown name otherwise failed every chat request with a 500.
    if name is not None:
        tool_call_format(name)


def _check_reasoning_parser(name: str | None) -> None:
    # Checked at start: an unknown name otherwise ended the gateway's startup in a traceback.
    if name is not None:
        reasoning_format(name)


def _check_api_keys(keys: list[str]) -> None:
    # `--api-key "$KEY"` with KEY unset gives an empty key, which ApiKeys drops: the gateway
    # would then serve without any key, the opposite of what was asked.
    if any(not key.strip() for key in keys):
        raise ValueError("an API key is empty or blank")


def _check_origins(origins: list[str]) -> None:
    # The Origin header is compared as a string: `https://app.example/` (a copied URL) or
    # `app.example` would never match it, leaving CORS off without a word.
    for origin in origins:
        parts = urlsplit(origin)
        if origin != "*" and (not parts.scheme or not parts.netloc
                              or origin != f"{parts.scheme}://{parts.netloc}"):
            raise ValueError(f"{origin!r} is not an origin: `scheme://host[:port]` with no path "
                             "or trailing slash, or `*`")


def _check_api_keys_file(path: str | None) -> None:
    # No key configured means no check: a keys file left empty or unreadable (a secret
    # not mounted yet) must stop the gateway, not open the API to anyone.
    if path is None:
        return
    try:
        keys = read_keys_file(path)
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the keys file: {error}") from None
    if not keys:
        raise ValueError("the keys file holds no key (one a line, `#` starts a comment)")


def _check_addresses(addresses: str | list[str]) -> None:
    # "nocolon" was taken, and the gateway waited for an engine at a target gRPC cannot dial.
    for address in [addresses] if isinstance(addresses, str) else addresses:
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"{address!r} is not host:port")


# The checks of the fields `backport up` passes on to the gateway, by field name: `up` runs
# them too, before anything starts, since the gateway starts last, after the engines loaded.
PASSED_ON_CHECKS: dict[str, Callable[[Any], None]] = {
    "tool_call_parser": _check_tool_call_parser,
    "reasoning_parser": _check_reasoning_parser,
    "api_key": _check_api_keys,
    "allowed_origin": _check_origins,
    "redis_url": check_redis_url,
    "api_keys_file": _check_api_keys_file,
}


def check_addresses_field(cls: type, value: Any) -> Any:
    _check_addresses(value)
    return value


def check_passed_on_field(cls: type, value: Any, info: ValidationInfo) -> Any:
    """A field validator of the PASSED_ON_CHECKS fields, for the settings classes that hold them."""
    assert info.field_name is not None
    PASSED_ON_CHECKS[info.field_name](value)
    return value


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BACKPORT_GATEWAY_", extra="forbid")

    host: str = Field("127.0.0.1", description="HTTP address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    engine: list[str] = Field(default_factory=list,
                              description=f"engine gRPC address host:port (default {DEFAULT_ENGINE} "
                                          "unless engines come from the Redis registry)")
    tokenizer: str = Field("127.0.0.1:50052", description="tokenizer gRPC address host:port")
    # A chat template over a long conversation (or a long prompt's encoding) can take seconds on
    # a busy CPU; 30 s is far past that, yet a hung tokenizer service fails its requests long
    # before an OpenAI client's own 600 s timeout would.
    tokenizer_timeout_s: float = Field(30.0, gt=0, description="deadline of each tokenizer-service "
                                                               "call a request makes (and of each "
                                                               "streamed detokenize step)")
    served_model_name: str | None = Field(None, description="model name for clients "
                                                            "(default: the engine's)")
    tool_call_parser: str | None = Field(None, description="deepseek_v4 | glm47 | qwen3_xml")
    reasoning_parser: str | None = Field(None, description="deepseek_v4 | glm45 | qwen3")
    redis_url: str | None = Field(None, description="Redis for shared state: sessions, stored "
                                                    "responses and the engine registry")
    response_ttl_s: float = Field(3600.0, gt=0, description="how long a stored response (Responses "
                                                            "API, `store`) may be continued or "
                                                            "retrieved")
    drain_timeout_s: float = Field(60.0, ge=0, description="SIGTERM: how long open streams may finish")
    routing_policy: RoutingPolicy = Field(RoutingPolicy.PREFIX, description="prefix | session | "
                                          "least_loaded | round_robin")
    prefix_block_tokens: int = Field(16, gt=0, description="prefix affinity: tokens per hashed block")
    prefix_affinity_tokens: int = Field(256, gt=0, description="prefix affinity: leading tokens "
                                                               "hashed at most")
    load_bound: float = Field(1.25, ge=1.0, description="affinity: most an engine may hold, as a "
                                                        "multiple of its fair share of in-flight "
                                                        "requests")
    load_slack: int = Field(4, ge=0, description="affinity: in-flight requests an engine may hold "
                                                  "beyond the bound")
    max_attempts: int = Field(3, ge=1, description="engines tried before the first token")
    retry_backoff_s: float = Field(0.05, ge=0, description="wait before the second attempt; "
                                                           "doubles after each")
    breaker_failures: int = Field(3, ge=1, description="consecutive failures that eject an engine")
    breaker_open_s: float = Field(5.0, gt=0, description="how long an ejected engine waits for "
                                                         "its health probe")
    health_interval_s: float = Field(0.5, gt=0, description="engine health probe period")
    registry_poll_s: float = Field(1.0, gt=0, description="engine registry read period")
    api_key: list[str] = Field(default_factory=list, description="accepted API key")
    api_keys_file: str | None = Field(None, description="file of accepted API keys, one a line")
    expose_engine_header: bool = Field(False, description="answer with an X-Backport-Engine header "
                                                          "naming the engines that served")
    # None by default, unlike vLLM's "*": with no API key, "*" would let any web page a user
    # opens read this server's answers.
    allowed_origin: list[str] = Field(default_factory=list,
                                      description="browser origin allowed to call the API (CORS; "
                                                  "`*` for any)")

    _passed_on_fields_hold = field_validator(*PASSED_ON_CHECKS)(check_passed_on_field)
    _addresses_are_host_port = field_validator("engine", "tokenizer")(check_addresses_field)
