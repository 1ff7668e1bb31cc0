"""The launcher contract: what the job manager hands an engine and what it hears back.

A :class:`Launcher` is shaped for remote engines: ``submit(launch) -> handle``,
``status(handle)``, ``cancel(handle)``, ``logs(handle, offset)``. The handle is a small
JSON object (a PID, a Slurm job id, a TrainJob name and namespace) that the job manager
stores in SQLite, so a restarted server asks the engine about a job instead of starting it
again. Every engine module builds on this one and on nothing else of the package.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from reshard_svc._process import set_pdeathsig, tagged_pids
from reshard_svc.jobs.argv import worker_argv
from reshard_svc.jobs.environment import JOB_ENV, LAUNCH_ENV, worker_env
from reshard_svc.jobs.spec import ConvertSpec

__all__ = [
    "ENGINE_STATES",
    "JOB_ENV",
    "LAUNCH_ENV",
    "Handle",
    "EngineStatus",
    "Launch",
    "Launcher",
    "LauncherError",
    "job_pids",
    "tagged_pids",
    "read_log",
    "set_pdeathsig",
]

logger = logging.getLogger(__name__)
#: What an engine may say about a job. ``lost``: the engine does not know it (any more).
ENGINE_STATES = ("pending", "running", "succeeded", "failed", "lost")

Handle = dict[str, Any]


class LauncherError(Exception):
    """The engine refused or failed a request (sbatch error, API error): the job fails."""


@dataclass(frozen=True, kw_only=True)
class Launch:
    """One attempt of a job, as the manager hands it to an engine."""

    job_id: str
    attempt: int
    spec: ConvertSpec
    env: dict[str, str]  # the operator's environment for workers
    log_path: Path  # where a local engine writes; remote engines keep their own
    callback_url: str | None = None  # where workers post their events
    callback_token: str | None = None  # this attempt's own token for it

    def environment(self, launch_id: str | None = None) -> dict[str, str]:
        """The workers' environment: :func:`~reshard_svc.jobs.environment.worker_env` of
        ``env`` with this job, its event callback and (a local engine's) ``launch_id``:
        the one place it is applied."""
        return worker_env(
            self.env,
            job_id=self.job_id,
            launch_id=launch_id,
            callback_url=self.callback_url,
            callback_token=self.callback_token,
        )

    @property
    def name(self) -> str:
        """A deterministic engine-side name: ``reshard-<job id>-<attempt>``."""
        return f"reshard-{self.job_id}-{self.attempt}"

    def worker_argv(self) -> list[str]:
        """``-m reshard_svc.worker convert ...``: the spec's own worker command line."""
        return worker_argv(self.spec)


@dataclass(frozen=True)
class EngineStatus:
    """What the engine says about a job. ``pending``: it keeps the job waiting, for
    ``reason`` (its own words, e.g. ``Slurm: PartitionNodeLimit``); ``hopeless``: a reason
    that cannot resolve by itself (the request exceeds the partition or cluster)."""

    state: str  # one of ENGINE_STATES
    reason: str | None = None
    hopeless: bool = False

    @property
    def active(self) -> bool:
        return self.state in ("pending", "running")


@runtime_checkable
class Launcher(Protocol):
    """How the job manager runs a job's workers on an engine."""

    name: str
    max_nodes: int

    def submit(self, launch: Launch) -> Handle:
        """Start the job; return what identifies it to the engine (stored in SQLite)."""
        ...

    def status(self, handle: Handle) -> EngineStatus: ...

    def cancel(self, handle: Handle, force: bool = False) -> None:
        """Ask the engine to stop the job (SIGTERM first; ``force`` kills)."""
        ...

    def logs(self, handle: Handle, offset: int, limit: int) -> tuple[bytes, int]:
        """Up to ``limit`` bytes of the job's log from ``offset``, and the log's size."""
        ...


def read_log(path: str | Path, offset: int, limit: int) -> tuple[bytes, int]:
    """``(bytes, size)`` of a log file; a missing file is empty."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(min(offset, size))
            return f.read(max(0, limit)), size
    except FileNotFoundError:
        return b"", 0


def job_pids(job_id: str) -> list[int]:
    """PIDs of live processes of any launch of job ``job_id``."""
    return tagged_pids(JOB_ENV, job_id)
