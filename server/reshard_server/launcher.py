"""Starting and stopping a job's workers.

:class:`Launcher` is the protocol the job manager talks to; :class:`LocalLauncher` runs
``torchrun --standalone --nproc-per-node N -m reshard_svc.worker ...`` as a subprocess on
this machine. Multi-node runs belong to an existing engine (torchrun c10d rendezvous under
Kubernetes or Slurm) behind the same protocol.

Every process of a job carries ``RESHARD_JOB_ID`` in its environment, so the launcher can
find them all — torchrun starts workers in their own sessions — even after a server
restart, and never mistakes a recycled PID for a job's process. The torchrun process dies
with the server (``PR_SET_PDEATHSIG``), and workers die with torchrun.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["JOB_ENV", "Launcher", "LocalLauncher", "job_pids", "set_pdeathsig"]

logger = logging.getLogger(__name__)
JOB_ENV = "RESHARD_JOB_ID"
_PR_SET_PDEATHSIG = 1


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


@runtime_checkable
class Launcher(Protocol):
    """How the job manager starts, watches and stops a job's workers."""

    def start(
        self, job_id: str, argv: list[str], nproc: int, log_path: Path, env: dict[str, str]
    ) -> None:
        """Start ``nproc`` workers running ``reshard_svc.worker`` with ``argv``."""
        ...

    def exit_code(self, job_id: str) -> int | None:
        """None while the job's launcher process runs; its exit code once it ended."""
        ...

    def signal(self, job_id: str, sig: int) -> int:
        """Send ``sig`` to every process of the job; returns how many were signalled."""
        ...

    def forget(self, job_id: str) -> None: ...


class LocalLauncher:
    """torchrun subprocesses on this machine."""

    def __init__(self, python: str | None = None) -> None:
        self.python = python or sys.executable
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, job_id: str, argv: list[str], nproc: int, log_path: Path, env: dict[str, str]
    ) -> None:
        cmd = [
            self.python, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "reshard_svc.worker", *argv,
        ]  # fmt: skip
        env = {
            **env,
            JOB_ENV: job_id,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self._procs[job_id] = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=set_pdeathsig,  # noqa: PLW1509 - only calls prctl
            )
        logger.info("job %s: started %d workers (pid %d)", job_id, nproc, self._procs[job_id].pid)

    def exit_code(self, job_id: str) -> int | None:
        proc = self._procs.get(job_id)
        if proc is None:
            return -1 if not job_pids(job_id) else None
        return proc.poll()

    def signal(self, job_id: str, sig: int) -> int:
        pids = job_pids(job_id)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return len(pids)

    def forget(self, job_id: str) -> None:
        proc = self._procs.pop(job_id, None)
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.wait(timeout=0)
