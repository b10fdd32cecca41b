"""The engine side's PLE settings: which service serves the table and how to use it.

Read from the engine process's environment (prefix BACKPORT_PLE_, the one `backport up`
sets for its engines); a bad value stops the engine with the variable's name."""

from __future__ import annotations

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "BACKPORT_PLE_"


class PleHookSettings(BaseSettings):
    # The service's own settings share the prefix; the engine ignores the ones it lacks.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    address: str = Field(description="host:port of the PLE service")
    shared_memory: bool = Field(True, description="map the table when it is on this machine; "
                                "false forces gRPC")
    gpu_gather: bool = Field(True, description="let a CUDA engine gather from the registered "
                             "table; false keeps the host gather + copy")
    reattach_timeout_s: float = Field(60.0, gt=0, description="how long a gather waits for a "
                                      "restarted service")
    connect_timeout_s: float = Field(900.0, ge=0, description="how long an engine waits at "
                                     "start for a service that is still loading its table")
    gather_threads: int = Field(4, ge=1, description="threads that split a large (prefill) "
                                "shared-memory gather")

    @classmethod
    def from_environment(cls) -> PleHookSettings:
        try:
            return cls()
        except ValidationError as exc:
            problems = "; ".join(
                f"{ENV_PREFIX}{'_'.join(map(str, error['loc'])).upper()}: {error['msg']}"
                for error in exc.errors())
            raise ValueError(f"PLE engine settings: {problems}") from None
