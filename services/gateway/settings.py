from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.mesh.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BACKPORT_GATEWAY_", extra="forbid")

    host: str = Field("127.0.0.1", description="HTTP address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    engine: list[str] = Field(default_factory=lambda: ["127.0.0.1:50051"],
                              description="engine gRPC address host:port")
    tokenizer: str = Field("127.0.0.1:50052", description="tokenizer gRPC address host:port")
    served_model_name: str | None = Field(None, description="model name for clients "
                                                            "(default: the engine's)")
    tool_call_parser: str | None = Field(None, description="deepseek_v4 | glm47 | qwen3_xml")
    reasoning_parser: str | None = Field(None, description="deepseek_v4 | glm45 | qwen3")
    redis_url: str | None = Field(None, description="Redis for shared state (sessions)")
    drain_timeout_s: float = Field(60.0, ge=0, description="SIGTERM: how long open streams may finish")
