from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.mesh.settings import ServiceSettings


class TokenizerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BACKPORT_TOKENIZER_", extra="forbid")

    model: str = Field(description="local HF model folder holding the tokenizer and chat template")
    host: str = Field("127.0.0.1", description="address to listen on (loopback unless told otherwise)")
    port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 picks a free one)")
    trust_remote_code: bool = Field(False, description="allow the checkpoint's own tokenizer code")
