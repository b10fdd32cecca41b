"""Settings of the PLE offload service (`backport ple`, env prefix BACKPORT_PLE_; the listen
address from BACKPORT_PLE_LISTEN_ADDRESS)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.mesh.settings import ServiceSettings
from services.ple_offload.segment_layout import segment_path
from services.ple_offload.table_format import RowDtype, TableExpectation


LISTEN_ADDRESS_ENV = "BACKPORT_PLE_LISTEN_ADDRESS"


class PleSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BACKPORT_PLE_", extra="forbid")

    # Not BACKPORT_PLE_ADDRESS: engines read that as the address of the service they use,
    # and a shell that exports it for its engines must not move where this service listens.
    address: str = Field("127.0.0.1:50071", validation_alias=LISTEN_ADDRESS_ENV,
                         description=f"gRPC listen address (host:port; env {LISTEN_ADDRESS_ENV})")
    table_path: Path = Field(description="safetensors file, or folder of them, holding the table")
    tensor_name: str | None = Field(
        None, description="table tensor stem, e.g. model.layers.0.ple.ple_embedding.ngram_embedding "
        "(reads <stem>.weight or <stem>.shard_<i>.weight); default: the only candidate")
    shm_name: str = Field("backport-ple", description="shared-memory name (a file in --shm-dir)")
    shm_dir: Path = Field(Path("/dev/shm"), description="tmpfs folder of the segment; one mounted "
                          "with huge=within_size gives the table huge pages (faster gathers)")
    expect_dtype: str | None = Field(None, description="refuse a table not of this dtype: fp8 or bf16")
    expect_rows: int | None = Field(None, gt=0, description="refuse a table without this many rows")
    expect_row_width: int | None = Field(None, gt=0, description="refuse a table of another row width")
    expect_header_sha256: str | None = Field(
        None, description="refuse a file whose header fingerprint (hex SHA-256) differs")
    show_progress: bool = Field(True, description="draw a progress bar while loading")
    grace_s: float = Field(5.0, ge=0, description="seconds in-flight lookups get on shutdown")
    cpus: list[int] = Field(
        default_factory=list, description="CPUs the service and all its threads run on; a CPU "
        "of its own shortens LookupStream's tail (docs/ple.md); default: any")

    def __init__(self, **values: Any) -> None:
        """`--address` sets the field by its name, which the environment cannot."""
        if "address" in values:
            values[LISTEN_ADDRESS_ENV] = values.pop("address")
        super().__init__(**values)

    # Checked here, so a bad value stops the service with its flag's name (status 2) before
    # it reads the table, instead of a traceback once it gets to use the value.
    @field_validator("expect_dtype")
    @classmethod
    def _known_dtype(cls, name: str | None) -> str | None:
        if name is not None:
            RowDtype.from_setting(name)
        return name

    @field_validator("shm_name")
    @classmethod
    def _usable_shm_name(cls, name: str) -> str:
        segment_path(name)
        return name

    @field_validator("shm_dir")
    @classmethod
    def _existing_shm_dir(cls, shm_dir: Path) -> Path:
        """Made absolute: `Describe` hands the folder to engines, whose working directory
        is not the service's."""
        if not shm_dir.is_dir():
            raise ValueError(f"{shm_dir} is not a folder (mount the tmpfs first)")
        # abspath, not resolve(): a symlinked folder keeps the name engines are told to mount.
        return Path(os.path.abspath(shm_dir))

    @field_validator("expect_header_sha256")
    @classmethod
    def _sha256_hex(cls, digest: str | None) -> str | None:
        if digest is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
            raise ValueError("a SHA-256 is 64 hex digits (the service prints it at every start)")
        return digest

    @field_validator("cpus")
    @classmethod
    def _cpus_available(cls, cpus: list[int]) -> list[int]:
        allowed = os.sched_getaffinity(0)
        if unavailable := sorted(set(cpus) - allowed):
            raise ValueError(f"CPUs {unavailable} are not available here (allowed: "
                             f"{sorted(allowed)})")
        return cpus

    def expectation(self) -> TableExpectation:
        return TableExpectation(
            dtype=RowDtype.from_setting(self.expect_dtype) if self.expect_dtype else None,
            num_rows=self.expect_rows,
            row_width=self.expect_row_width,
            header_sha256_hex=self.expect_header_sha256,
        )
