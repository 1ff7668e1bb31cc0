"""Request and response models: ``JobCreate`` in, ``JobPublic`` out (shared with the client)."""

from __future__ import annotations

import math
import re
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

__all__ = [
    "CheckpointInfo",
    "JobCreate",
    "JobList",
    "JobLogs",
    "JobPublic",
    "JobState",
    "ProgressPublic",
]

_MESH_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"^\s*\d+(\.\d+)?\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


class JobState(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


class JobCreate(BaseModel):
    """A conversion to run: ``source`` -> ``target`` with a new mesh / rules / format."""

    model_config = ConfigDict(extra="forbid")

    source: Annotated[
        str, Field(min_length=1, max_length=4096, description="checkpoint URI to read")
    ]
    target: Annotated[str, Field(min_length=1, max_length=4096, description="new checkpoint URI")]
    mesh: dict[str, Annotated[int, Field(ge=1, le=1_000_000)]] | None = Field(
        default=None, description='target mesh, e.g. {"tp": 2} or {"dp": 2, "tp": 4}'
    )
    rules: dict[str, str | list[str]] | None = Field(
        default=None, description="tensor-name glob -> placements, first match wins"
    )
    format: Literal["native", "hf"] = "native"
    dtype: Literal["bf16", "fp16", "fp32"] | None = None
    workers: Annotated[StrictInt, Field(ge=1, le=4096)] = 1
    strategy: Literal["auto", "exchange", "direct"] = "auto"
    checksum: Literal["crc32c", "sha256", "none"] = Field(
        default="crc32c", description="what the output records (crc32c block CRCs by default)"
    )
    max_memory: str | None = Field(
        default=None, max_length=32, description="per-worker budget, e.g. 1GiB"
    )

    @field_validator("mesh")
    @classmethod
    def _mesh(cls, v: dict[str, int] | None) -> dict[str, int] | None:
        if v is not None:
            if not v or len(v) > 8:
                raise ValueError("mesh needs 1 to 8 named dims, e.g. {'tp': 2}")
            for name in v:
                if not _MESH_NAME.match(name):
                    raise ValueError(f"mesh dim name {name!r} must be an identifier")
            from reshard_svc.layout import MAX_MESH_SIZE

            if math.prod(v.values()) > MAX_MESH_SIZE:
                raise ValueError(f"mesh spans more than {MAX_MESH_SIZE} ranks")
        return v

    @field_validator("rules")
    @classmethod
    def _rules(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and len(v) > 1000:
            raise ValueError("at most 1000 rules")
        if v is not None:
            from reshard_svc.errors import LayoutError
            from reshard_svc.layout import parse_placements

            for glob, pls in v.items():
                try:
                    parse_placements(pls)
                except LayoutError as e:
                    raise ValueError(f"rule {glob!r}: {e}") from None
        return v

    @field_validator("max_memory")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None and not _SIZE.match(v):
            raise ValueError("max_memory must look like 512MiB, 1GiB or a byte count")
        return v

    def mesh_text(self) -> str | None:
        return ",".join(f"{k}={n}" for k, n in self.mesh.items()) if self.mesh else None


class ProgressPublic(BaseModel):
    bytes_done: int = 0
    bytes_total: int = 0
    tensors_done: int = 0
    tensors_total: int = 0


class JobPublic(BaseModel):
    id: str
    state: JobState
    spec: JobCreate
    source: str
    target: str
    progress: ProgressPublic
    throughput_bytes_per_s: float | None = None
    error: str | None = None
    attempts: int = 0
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class JobList(BaseModel):
    items: list[JobPublic]
    total: int
    limit: int
    offset: int


class JobLogs(BaseModel):
    id: str
    offset: int
    next_offset: int
    size: int
    text: str


class CheckpointInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    uri: str
    source: str
    tensors_count: int
    total_bytes: int
    files_count: int
