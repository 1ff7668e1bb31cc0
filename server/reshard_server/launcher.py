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

Local jobs cannot outlive the server: torchrun dies with the server (``PR_SET_PDEATHSIG``)
and workers with torchrun; after a restart the job is ``lost`` and the manager re-queues
it. Recovery only stops processes it can prove this launch started: every process of a
launch carries ``RESHARD_LAUNCH_ID`` (job, attempt and a random part) in its environment,
and the handle records torchrun's pid with its start time.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from reshard_svc.plan.spec import ConvertSpec
from reshard_svc.storage.leases import alive, process_start

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
    "tagged_pids",
    "make_launcher",
    "read_log",
    "set_pdeathsig",
]

logger = logging.getLogger(__name__)
JOB_ENV = "RESHARD_JOB_ID"
LAUNCH_ENV = "RESHARD_LAUNCH_ID"
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
        """``-m reshard_svc.worker convert ...``: the spec's own worker command line."""
        return self.spec.worker_argv()


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


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def tagged_pids(name: str, value: str) -> list[int]:
    """PIDs of live (not zombie) processes whose environment carries ``name=value``."""
    tag = f"{name}={value}".encode() + b"\0"
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read() + b"\0"
        except OSError:
            continue
        if b"\0" + tag in b"\0" + env and alive(int(entry)):
            out.append(int(entry))
    return out


def job_pids(job_id: str) -> list[int]:
    """PIDs of live processes of any launch of job ``job_id``."""
    return tagged_pids(JOB_ENV, job_id)


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
            f"--nproc-per-node={launch.spec.workers_per_node}", *launch.worker_argv(),
        ]  # fmt: skip
        launch_id = f"{launch.name}-{uuid.uuid4().hex[:8]}"
        env = {
            **launch.env,
            JOB_ENV: launch.job_id,
            LAUNCH_ENV: launch_id,
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
        return {"job_id": launch.job_id, "pid": proc.pid, "start": process_start(proc.pid),
                "launch": launch_id, "log": str(launch.log_path)}  # fmt: skip

    def status(self, handle: Handle) -> EngineStatus:
        proc = self._procs.get(handle["job_id"])
        if proc is None or proc.pid != handle.get("pid"):
            return EngineStatus("lost", "the server restarted while the job ran")
        code = proc.poll()
        if code is None:
            return EngineStatus("running")
        self._procs.pop(handle["job_id"], None)
        self._signal(handle, signal.SIGKILL)  # stragglers, if any
        if code == 0:
            return EngineStatus("succeeded")
        return EngineStatus("failed", f"workers exited with code {code}; see the job's logs")

    def cancel(self, handle: Handle, force: bool = False) -> None:
        self._signal(handle, signal.SIGKILL if force else signal.SIGTERM)

    def logs(self, handle: Handle, offset: int, limit: int) -> tuple[bytes, int]:
        return read_log(handle["log"], offset, limit)

    def _signal(self, handle: Handle, sig: int) -> int:
        """Signal the processes this launch started, and only them: those whose
        environment carries its launch id, and torchrun itself if it is still the
        process the handle recorded (pid and start time)."""
        pids = set(tagged_pids(LAUNCH_ENV, handle["launch"])) if "launch" in handle else set()
        pid, start = handle.get("pid"), handle.get("start")
        if pid and start and alive(pid, start):
            pids.add(pid)
        if "launch" not in handle:  # a handle from before launch ids
            pids |= set(job_pids(handle["job_id"]))
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)
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
