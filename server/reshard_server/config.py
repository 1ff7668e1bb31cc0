"""Server settings from the environment (``RESHARD_*``) and ``reshard-server`` flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    """Operator configuration. Storage endpoints and credentials are the server's own
    environment (fsspec's ``FSSPEC_S3``/AWS variables), never taken from a request."""

    model_config = SettingsConfigDict(env_prefix="RESHARD_", extra="ignore")

    token: str = Field(default="", description="bearer token every request but /healthz must carry")
    roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated local paths or URI prefixes that jobs may read and write",
    )
    db: str = Field(default="reshard-server.db", description="SQLite database file")
    data_dir: str = Field(default="reshard-server-data", description="job logs and progress files")
    host: str = "127.0.0.1"
    port: int = 8000
    max_running: int = Field(default=1, ge=1)
    max_queued: int = Field(default=16, ge=0)
    max_workers: int = Field(default=8, ge=1, description="largest 'workers' a job may ask for")
    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    cancel_grace_s: float = Field(default=10.0, ge=0)
    max_retries: int = Field(default=2, ge=0, description="re-queues after a server restart")
    allow_dcp_pickle: bool = Field(
        default=False, description="let jobs read torch DCP .distcp (pickled metadata)"
    )
    worker_python: str = Field(default="", description="python for workers (default: this one)")
    poll_interval_s: float = Field(default=0.2, gt=0)

    @field_validator("roots", mode="before")
    @classmethod
    def _split_roots(cls, v: object) -> object:
        if isinstance(v, str):
            return [r.strip() for r in v.split(",") if r.strip()]
        return v

    def log_dir(self) -> Path:
        p = Path(self.data_dir) / "jobs"
        p.mkdir(parents=True, exist_ok=True)
        return p

    def worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["RESHARD_ALLOW_DCP_PICKLE"] = "1" if self.allow_dcp_pickle else "0"
        env.pop("RESHARD_TOKEN", None)  # workers never need the API token
        return env
