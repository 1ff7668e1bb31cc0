"""``RESHARD_LAUNCHER=ray``: jobs on a Ray cluster, through Ray's own job submission API.

- **submit**: ``JobSubmissionClient.submit_job`` (``RESHARD_RAY_ADDRESS``, the cluster's
  dashboard address) with the entrypoint ``python -m reshard_svc.jobs.ray_entry --nodes N
  --workers-per-node W -- <worker argv>`` (:mod:`reshard_svc.jobs.ray_entry`): a
  ``STRICT_SPREAD`` placement group of N bundles of W CPUs, then one torchrun agent per
  bundle, as on Slurm. The worker's own variables and the storage settings go in the job's
  ``runtime_env``; the API token never does. The submission id is the launch's name and a
  random part, so a retry never collides with an old job.
- **status**: the Ray job's status; while it runs, the entrypoint's last ``ray-entry:``
  line says whether Ray is still placing it (queued, with Ray's reason; hopeless when the
  cluster has fewer nodes than asked, so the job fails after ``pending_timeout_s``).
- **cancel**: ``stop_job`` (Ray stops the entrypoint, then its tasks; each torchrun agent
  and its workers die with their Ray worker, before any commit). **logs**: Ray's job logs.

A restarted server asks Ray about the stored submission id: it re-attaches.
"""

from __future__ import annotations

import logging
import shlex
import sys
import uuid
from typing import Any

from reshard_server.config import Settings
from reshard_server.launchers.base import EngineStatus, Handle, Launch, LauncherError
from reshard_svc.jobs.ray_entry import STATUS

__all__ = ["RayLauncher", "entrypoint", "runtime_env"]

logger = logging.getLogger(__name__)

#: Operator variables a Ray worker needs besides the job's own (storage, logging).
PASSED_PREFIXES = ("RESHARD_", "AWS_", "FSSPEC_")
PASSED = ("LOGLEVEL", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")
NEVER = ("RESHARD_TOKEN", "RESHARD_AUTH_FILE", "RESHARD_JWT_SECRET")


def entrypoint(launch: Launch, python: str) -> str:
    """The shell command Ray runs for one attempt of a job."""
    spec = launch.spec
    cmd = [
        python,
        "-m",
        "reshard_svc.jobs.ray_entry",
        "--nodes",
        str(spec.nodes),
        "--workers-per-node",
        str(spec.workers_per_node),
        "--",
        *launch.worker_argv(),
    ]
    return shlex.join(cmd)


def runtime_env(launch: Launch) -> dict[str, Any]:
    """The job's environment on the cluster: its own variables and the storage settings."""
    env = launch.environment()
    keep = {
        k: v
        for k, v in env.items()
        if (k.startswith(PASSED_PREFIXES) or k in PASSED) and k not in NEVER
    }
    return {"env_vars": keep}


class RayLauncher:
    """Jobs as Ray jobs on the cluster at ``settings.ray_address``."""

    name = "ray"
    max_nodes = 1 << 16  # the cluster says what fits: a job too large waits, then fails

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.python = settings.worker_python or sys.executable
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                from ray.job_submission import JobSubmissionClient
            except ImportError as e:  # pragma: no cover (the extra is in the dev set)
                raise LauncherError(
                    "RESHARD_LAUNCHER=ray needs `pip install reshard-svc[ray]`"
                ) from e
            try:
                self._client = JobSubmissionClient(self.settings.ray_address)
            except Exception as e:  # connection refused, not a Ray dashboard
                raise LauncherError(f"Ray at {self.settings.ray_address}: {e}") from e
        return self._client

    def submit(self, launch: Launch) -> Handle:
        sid = f"{launch.name}-{uuid.uuid4().hex[:8]}"
        try:
            self.client.submit_job(
                entrypoint=entrypoint(launch, self.python),
                submission_id=sid,
                runtime_env=runtime_env(launch),
                metadata={"reshard_job": launch.job_id},
            )
        except LauncherError:
            raise
        except Exception as e:
            raise LauncherError(f"Ray refused the job: {e}") from e
        logger.info("job %s: Ray job %s", launch.job_id, sid)
        return {"ray_job": sid, "address": self.settings.ray_address}

    def status(self, handle: Handle) -> EngineStatus:
        try:
            info = self.client.get_job_info(handle["ray_job"])
        except LauncherError:
            raise
        except Exception as e:
            if "does not exist" in str(e) or "404" in str(e):
                return EngineStatus("lost", f"Ray does not know job {handle['ray_job']}")
            raise LauncherError(f"Ray at {self.settings.ray_address}: {e}") from e
        state = str(getattr(info.status, "value", info.status))
        if state == "PENDING":
            return EngineStatus("pending", f"Ray: job pending ({info.message or 'starting'})")
        if state == "RUNNING":
            return self._placing(handle) or EngineStatus("running")
        if state == "SUCCEEDED":
            return EngineStatus("succeeded")
        why = info.message or state.lower()
        return EngineStatus("failed", f"Ray job {state.lower()}: {why}; see the job's logs")

    def _placing(self, handle: Handle) -> EngineStatus | None:
        """Pending, with Ray's words, while the entrypoint still waits for its nodes."""
        last = None
        for line in self._text(handle).splitlines():
            if line.startswith(STATUS):
                last = line[len(STATUS) :].split(None, 2)
        if not last or last[0] != "pending":
            return None
        hopeless = len(last) > 1 and last[1] == "hopeless"
        return EngineStatus("pending", last[2] if len(last) > 2 else "Ray: placing", hopeless)

    def cancel(self, handle: Handle, force: bool = False) -> None:
        try:
            self.client.stop_job(handle["ray_job"])
        except LauncherError:
            raise
        except Exception as e:
            if "does not exist" not in str(e):
                raise LauncherError(f"Ray could not stop {handle['ray_job']}: {e}") from e

    def logs(self, handle: Handle, offset: int, limit: int) -> tuple[bytes, int]:
        data = self._text(handle).encode()
        start = min(max(0, offset), len(data))
        return data[start : start + max(0, limit)], len(data)

    def _text(self, handle: Handle) -> str:
        try:
            return str(self.client.get_job_logs(handle["ray_job"]))
        except LauncherError:
            raise
        except Exception:
            return ""
