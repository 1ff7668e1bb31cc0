"""Server settings from the environment (``RESHARD_*``) and ``reshard-server`` flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings"]


def state_dir() -> Path:
    """Where the server keeps its state by default: ``$XDG_STATE_HOME/reshard-server``
    (``~/.local/state/reshard-server``), never the folder it was started from."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "reshard-server"


class Settings(BaseSettings):
    """Operator configuration. Storage endpoints and credentials are the server's own
    environment (fsspec's ``FSSPEC_S3``/AWS variables), never taken from a request."""

    model_config = SettingsConfigDict(env_prefix="RESHARD_", extra="ignore")

    token: str = Field(default="", description="bearer token every request but /healthz must carry")
    auth_file: str = Field(
        default="",
        description="YAML file of users, their scopes, roots, quotas and hashed tokens "
        "(reshard-server token add); read again whenever it changes",
    )
    jwt_issuer: str = Field(
        default="", description="accept bearer JWTs from this issuer (iss); empty: no JWTs"
    )
    jwt_audience: str = Field(default="", description="the JWTs' required audience (aud)")
    jwt_jwks: str = Field(
        default="",
        description="the issuer's signing keys: a JWKS file, or an https URL (fetched, cached)",
    )
    jwt_user_claim: str = Field(default="sub", description="the claim naming the user")
    jwt_scopes_claim: str = Field(
        default="scope",
        description="the claim holding scopes (a space-separated string or a list); values "
        "'reshard:read', 'reshard:submit', 'reshard:cancel', 'reshard:admin' map to scopes",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated Host names the server answers to, besides localhost, "
        "its bind address and RESHARD_PUBLIC_URL's host (a DNS-rebinding guard)",
    )
    roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated local paths or URI prefixes that jobs may read and write",
    )
    db: str = Field(
        default_factory=lambda: str(state_dir() / "jobs.db"), description="SQLite database file"
    )
    data_dir: str = Field(
        default_factory=lambda: str(state_dir() / "data"),
        description="job logs and progress files",
    )
    host: str = Field(default="127.0.0.1", description="bind address (--host)")
    port: int = Field(default=8000, description="port (--port)")
    max_running: int = Field(default=1, ge=1, description="jobs an engine runs (or holds) at once")
    max_queued: int = Field(default=16, ge=0, description="queued jobs before a submit gets 429")
    max_workers: int = Field(
        default=8, ge=1, description="most workers (nodes x workers_per_node) a job may ask for"
    )
    max_nodes: int = Field(default=64, ge=1, description="most nodes a job may ask for")
    launcher: Literal["local", "slurm", "kubernetes", "ray"] = Field(
        default="local",
        description="where workers run: this host, Slurm, Kubeflow Trainer or a Ray cluster",
    )
    public_url: str = Field(
        default="",
        description="URL workers reach this server at, for progress callbacks "
        "(default: http://HOST:PORT of the listening socket)",
    )
    # Slurm (RESHARD_LAUNCHER=slurm)
    slurm_partition: str = Field(default="", description="sbatch --partition")
    slurm_account: str = Field(default="", description="sbatch --account")
    slurm_time: str = Field(default="", description="sbatch --time, e.g. 02:00:00")
    slurm_gpus_per_node: int = Field(
        default=0, ge=0, description="sbatch --gpus-per-node (workers then use NCCL)"
    )
    slurm_extra_args: str = Field(default="", description="more sbatch options, shell-quoted")
    slurm_log_dir: str = Field(
        default="", description="job logs; on storage the server can read (default DATA_DIR/slurm)"
    )
    # Ray (RESHARD_LAUNCHER=ray)
    ray_address: str = Field(
        default="http://127.0.0.1:8265",
        description="the Ray cluster's dashboard (job API) address, as `ray job submit` takes",
    )
    # Kubernetes (RESHARD_LAUNCHER=kubernetes)
    k8s_namespace: str = Field(default="default", description="where TrainJobs go")
    k8s_image: str = Field(default="", description="worker image with reshard-svc installed")
    k8s_runtime: str = Field(default="torch-distributed", description="ClusterTrainingRuntime")
    k8s_gpus_per_node: int = Field(
        default=0, ge=0, description="resourcesPerNode nvidia.com/gpu of each node pod"
    )
    k8s_service_account: str = Field(default="", description="the node pods' ServiceAccount")
    k8s_storage_secret: str = Field(
        default="", description="Secret whose keys become the workers' storage credentials"
    )
    k8s_secret_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
            "FSSPEC_S3_ENDPOINT_URL",
        ],
        description="keys of the storage Secret passed to workers (missing ones are skipped)",
    )
    max_body_bytes: int = Field(default=64 * 1024, ge=1024, description="request body limit (413)")
    cancel_grace_s: float = Field(
        default=10.0, ge=0, description="seconds from SIGTERM to SIGKILL when cancelling"
    )
    pending_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="fail a job its engine keeps waiting for a reason that cannot resolve by "
        "itself (a request larger than the partition or cluster) after this many seconds",
    )
    max_retries: int = Field(default=2, ge=0, description="re-queues after a server restart")
    allow_dcp_pickle: bool = Field(
        default=False, description="let jobs read torch DCP .distcp (pickled metadata)"
    )
    worker_python: str = Field(default="", description="python for workers (default: this one)")
    poll_interval_s: float = Field(default=0.2, gt=0, description="how often engines are asked")
    watch_interval_s: float = Field(
        default=10.0, gt=0, description="how often watched roots are scanned for new steps"
    )

    @field_validator("roots", "k8s_secret_keys", "allowed_hosts", mode="before")
    @classmethod
    def _split_roots(cls, v: object) -> object:
        if isinstance(v, str):
            return [r.strip() for r in v.split(",") if r.strip()]
        return v

    def log_dir(self) -> Path:
        p = Path(self.data_dir) / "jobs"
        p.mkdir(parents=True, exist_ok=True)
        return p

    def callback_base(self) -> str:
        """Where workers POST progress: ``RESHARD_PUBLIC_URL`` or the listening address."""
        if self.public_url:
            return self.public_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            import socket

            host = socket.getfqdn()
        return f"http://{host}:{self.port}"

    def worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["RESHARD_ALLOW_DCP_PICKLE"] = "1" if self.allow_dcp_pickle else "0"
        env.pop("RESHARD_TOKEN", None)  # workers never need the API token
        return env
