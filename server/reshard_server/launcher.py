"""Where a job's workers run: the launcher contract and the local engine.

A :class:`Launcher` is shaped for remote engines: ``submit(launch) -> handle``,
``status(handle)``, ``cancel(handle)``, ``logs(handle, offset)``. The handle is a small
JSON object (a PID, a Slurm job id, a TrainJob name and namespace) that the job manager
stores in SQLite, so a restarted server asks the engine about a job instead of starting it
again. ``RESHARD_LAUNCHER`` picks one (:func:`make_launcher`):

- ``local`` (default): ``torchrun --standalone`` subprocesses on this machine
  (:class:`LocalLauncher`).
- ``slurm``: ``sbatch`` / ``squeue`` / ``scancel`` (:mod:`reshard_server.slurm`).
- ``kubernetes``: Kubeflow Trainer ``TrainJob`` objects (:mod:`reshard_server.kubernetes`).

Local jobs cannot outlive the server: every process carries ``RESHARD_JOB_ID`` in its
environment, torchrun dies with the server (``PR_SET_PDEATHSIG``) and workers with
torchrun; after a restart the job is ``lost`` and the manager re-queues it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from reshard_svc.plan.spec import ConvertSpec

if TYPE_CHECKING:
    from reshard_server.config import Settings

__all__ = [
    "ENGINE_STATES",
    "JOB_ENV",
    "EngineStatus",
    "Launch",
    "Launcher",
    "LauncherError",
    "LocalLauncher",
    "job_pids",
    "make_launcher",
    "read_log",
    "set_pdeathsig",
]

logger = logging.getLogger(__name__)
JOB_ENV = "RESHARD_JOB_ID"
_PR_SET_PDEATHSIG = 1
#: What an engine may say about a job. ``lost``: the engine does not know it (any more).
ENGINE_STATES = ("pending", "running", "succeeded", "failed", "lost")

Handle = dict[str, Any]


class LauncherError(Exception):
    """The engine refused or failed a request (sbatch error, API error): the job fails."""


@dataclass(frozen=True)
class Launch:
    """One attempt of a job, as the manager hands it to an engine."""

    job_id: str
    attempt: int
    spec: ConvertSpec
    env: dict[str, str]  # RESHARD_JOB_ID, callback URL and token, operator env
    log_path: Path  # where a local engine writes; remote engines keep their own

    @property
    def name(self) -> str:
        """A deterministic engine-side name: ``reshard-<job id>-<attempt>``."""
        return f"reshard-{self.job_id}-{self.attempt}"

    def worker_argv(self) -> list[str]:
        return self.spec.to_argv()


@dataclass(frozen=True)
class EngineStatus:
    state: str  # one of ENGINE_STATES
    reason: str | None = None

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


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def job_pids(job_id: str) -> list[int]:
    """PIDs of live processes whose environment carries ``RESHARD_JOB_ID=job_id``."""
    tag = f"{JOB_ENV}={job_id}".encode() + b"\0"
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read() + b"\0"
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[-1].split()[0]
        except OSError:
            continue
        if b"\0" + tag in b"\0" + env and state != b"Z":
            out.append(int(entry))
    return out


class LocalLauncher:
    """``torchrun --standalone`` subprocesses on this machine (one node)."""

    name = "local"
    max_nodes = 1

    def __init__(self, python: str | None = None) -> None:
        self.python = python or sys.executable
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def submit(self, launch: Launch) -> Handle:
        cmd = [
            self.python, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={launch.spec.workers_per_node}", "-m", "reshard_svc.worker",
            *launch.worker_argv(),
        ]  # fmt: skip
        env = {
            **launch.env,
            JOB_ENV: launch.job_id,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": launch.env.get("OMP_NUM_THREADS", "1"),
        }
        with open(launch.log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=set_pdeathsig,  # noqa: PLW1509 - only calls prctl
            )
        self._procs[launch.job_id] = proc
        logger.info("job %s: started %d workers (pid %d)", launch.job_id, launch.spec.workers,
                    proc.pid)  # fmt: skip
        return {"job_id": launch.job_id, "pid": proc.pid, "log": str(launch.log_path)}

    def status(self, handle: Handle) -> EngineStatus:
        proc = self._procs.get(handle["job_id"])
        if proc is None or proc.pid != handle.get("pid"):
            return EngineStatus("lost", "the server restarted while the job ran")
        code = proc.poll()
        if code is None:
            return EngineStatus("running")
        self._procs.pop(handle["job_id"], None)
        self._signal(handle["job_id"], signal.SIGKILL)  # stragglers, if any
        if code == 0:
            return EngineStatus("succeeded")
        return EngineStatus("failed", f"workers exited with code {code}; see the job's logs")

    def cancel(self, handle: Handle, force: bool = False) -> None:
        self._signal(handle["job_id"], signal.SIGKILL if force else signal.SIGTERM)

    def logs(self, handle: Handle, offset: int, limit: int) -> tuple[bytes, int]:
        return read_log(handle["log"], offset, limit)

    def _signal(self, job_id: str, sig: int) -> int:
        pids = job_pids(job_id)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return len(pids)


def make_launcher(settings: Settings) -> Launcher:
    """The engine ``settings.launcher`` names."""
    if settings.launcher == "slurm":
        from reshard_server.slurm import SlurmLauncher

        return SlurmLauncher(settings)
    if settings.launcher == "kubernetes":
        from reshard_server.kubernetes import KubernetesLauncher

        return KubernetesLauncher(settings)
    return LocalLauncher(settings.worker_python or None)
