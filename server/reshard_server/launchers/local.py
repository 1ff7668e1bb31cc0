"""The local engine: ``torchrun --standalone`` subprocesses on this machine.

Local jobs cannot outlive the server: torchrun dies with the server (``PR_SET_PDEATHSIG``)
and workers with torchrun; after a restart the job is ``lost`` and the manager re-queues
it. Recovery only stops processes it can prove this launch started: every process of a
launch carries ``RESHARD_LAUNCH_ID`` (job, attempt and a random part) in its environment,
and the handle records torchrun's pid with its start time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import uuid

from reshard_server.launchers.base import (
    LAUNCH_ENV,
    EngineStatus,
    Handle,
    Launch,
    job_pids,
    read_log,
    set_pdeathsig,
    tagged_pids,
)
from reshard_svc._process import alive, process_start

__all__ = ["LocalLauncher"]

logger = logging.getLogger(__name__)


class LocalLauncher:
    """``torchrun --standalone`` subprocesses on this machine (one node)."""

    name = "local"
    max_nodes = 1

    def __init__(self, python: str | None = None) -> None:
        self.python = python or sys.executable
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def submit(self, launch: Launch) -> Handle:
        cmd = [
            self.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={launch.spec.workers_per_node}",
            *launch.worker_argv(),
        ]
        launch_id = f"{launch.name}-{uuid.uuid4().hex[:8]}"
        env = launch.environment(launch_id)
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
        logger.info(
            "job %s: started %d workers (pid %d)", launch.job_id, launch.spec.workers, proc.pid
        )
        return {
            "job_id": launch.job_id,
            "pid": proc.pid,
            "start": process_start(proc.pid),
            "launch": launch_id,
            "log": str(launch.log_path),
        }

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
