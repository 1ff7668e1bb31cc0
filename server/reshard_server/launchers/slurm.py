"""``RESHARD_LAUNCHER=slurm``: jobs as Slurm batch jobs, one torchrun agent per task.

- **submit**: ``sbatch --parsable`` with a generated script (kept next to the log) that
  runs ``srun python -m torch.distributed.run --nnodes $SLURM_NTASKS --nproc-per-node G
  --rdzv-backend c10d --rdzv-endpoint <first node>:<port> --rdzv-id $SLURM_JOB_ID -m
  reshard_svc.worker convert ...``. The job gets ``--nodes N --ntasks N
  --ntasks-per-node 1``; options on the sbatch command line (``RESHARD_SLURM_EXTRA_ARGS``)
  override the script's ``#SBATCH`` lines. The submitter's environment (the callback URL and
  token, storage settings) is exported to the job; the API token never is.
- **status**: ``squeue --json`` while the controller knows the job, then ``scontrol show
  job``, then ``sacct --json`` when accounting is configured.
- **cancel**: ``scancel`` (Slurm sends SIGTERM, then SIGKILL after ``KillWait``);
  ``force`` sends SIGKILL at once. **logs**: the ``--output`` file, which must be on
  storage the server can read (``RESHARD_SLURM_LOG_DIR``).
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from reshard_server.config import Settings
from reshard_server.launchers.base import (
    EngineStatus,
    Handle,
    Launch,
    LauncherError,
    read_log,
)

__all__ = ["SlurmLauncher", "render_script", "slurm_state"]

logger = logging.getLogger(__name__)

_PENDING = {
    "PENDING",
    "CONFIGURING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "STAGE_OUT",
    "SIGNALING",
}
_RUNNING = {"RUNNING", "COMPLETING"}
#: Reasons a pending job has that no amount of waiting fixes: the request exceeds what the
#: partition, account or QOS allows.
HOPELESS = {
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "PartitionConfig",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSMaxNodePerJobLimit",
    "QOSMaxCpuPerJobLimit",
    "QOSMaxGRESPerJob",
    "QOSMaxMemoryPerJob",
    "QOSMaxWallDurationPerJobLimit",
}
_FAILED_REASONS = {
    "FAILED": "the job failed",
    "CANCELLED": "the job was cancelled in Slurm",
    "TIMEOUT": "the job hit its time limit (RESHARD_SLURM_TIME)",
    "NODE_FAIL": "a node failed",
    "OUT_OF_MEMORY": "a task ran out of memory",
    "PREEMPTED": "the job was preempted",
    "BOOT_FAIL": "a node failed to boot",
    "DEADLINE": "the job missed its deadline",
    "REVOKED": "the job was revoked",
}


def slurm_state(
    state: str, reason: str | None = None, exit_code: str | None = None
) -> EngineStatus:
    """Map a Slurm job state (``COMPLETED``, ``OUT_OF_MEMORY``, ...) to an engine status."""
    base = state.split()[0].split("+")[0].upper() if state else ""
    if base in _PENDING:
        why = reason if reason and reason != "None" else base.lower()
        return EngineStatus("pending", f"Slurm: {why}", hopeless=why in HOPELESS)
    if base in _RUNNING:
        return EngineStatus("running")
    if base == "COMPLETED":
        return EngineStatus("succeeded")
    why = _FAILED_REASONS.get(base, f"Slurm state {state}")
    details = [
        d for d in (f"exit code {exit_code}" if exit_code else "", reason) if d and d != "None"
    ]
    return EngineStatus("failed", f"slurm: {why}" + (f" ({', '.join(details)})" if details else ""))


def render_script(launch: Launch, settings: Settings, python: str, log: Path) -> str:
    """The sbatch script for one attempt of a job."""
    spec = launch.spec
    gpus = settings.slurm_gpus_per_node
    per_node = spec.workers_per_node
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={launch.name}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --ntasks={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={per_node}",
        f"#SBATCH --output={log}",
        "#SBATCH --open-mode=append",
        "#SBATCH --export=ALL",
    ]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    for flag, value in (
        ("partition", settings.slurm_partition),
        ("account", settings.slurm_account),
        ("time", settings.slurm_time),
    ):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    worker = " ".join(shlex.quote(a) for a in launch.worker_argv())
    lines += [
        "set -euo pipefail",
        "# One torchrun agent per Slurm task; c10d rendezvous on the first node.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "port=$((20000 + SLURM_JOB_ID % 20000))",
        'echo "reshard: job $SLURM_JOB_ID, $SLURM_NTASKS torchrun nodes, rendezvous $head:$port"',
        "srun --kill-on-bad-exit=1 --cpus-per-task=$SLURM_CPUS_PER_TASK \\",
        f"  {shlex.quote(python)} -m torch.distributed.run \\",
        f'  --nnodes "$SLURM_NTASKS" --nproc-per-node {per_node} \\',
        '  --rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" \\',
        f"  {worker}",
        "",
    ]
    return "\n".join(lines)


class SlurmLauncher:
    """Submit, watch, cancel and read logs of Slurm jobs through the Slurm CLI."""

    name = "slurm"
    max_nodes = 1 << 16

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.python = settings.worker_python or sys.executable
        self.log_dir = Path(settings.slurm_log_dir or Path(settings.data_dir) / "slurm")
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def _run(
        self, *cmd: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                list(cmd), capture_output=True, text=True, timeout=60, env=env, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LauncherError(f"{cmd[0]}: {e}") from e

    def submit(self, launch: Launch) -> Handle:
        log = self.log_dir / f"{launch.name}.log"
        script = self.log_dir / f"{launch.name}.sbatch"
        script.write_text(render_script(launch, self.settings, self.python, log))
        extra = shlex.split(self.settings.slurm_extra_args)
        env = launch.environment()
        r = self._run("sbatch", "--parsable", *extra, str(script), env=env)
        if r.returncode != 0:
            raise LauncherError(f"sbatch failed: {r.stderr.strip() or r.stdout.strip()}")
        slurm_id = r.stdout.strip().split(";")[0]
        if not slurm_id.isdigit():
            raise LauncherError(f"sbatch printed {r.stdout!r}, not a job id")
        logger.info("job %s: Slurm job %s (%s)", launch.job_id, slurm_id, script)
        return {"slurm_job_id": slurm_id, "log": str(log), "script": str(script)}

    def status(self, handle: Handle) -> EngineStatus:
        jid = handle["slurm_job_id"]
        for probe in (self._squeue, self._scontrol, self._sacct):
            found = probe(jid)
            if found is not None:
                return found
        return EngineStatus("lost", f"Slurm no longer knows job {jid}")

    def _json_job(self, jid: str, *cmd: str) -> dict[str, Any] | None:
        """This job's record in ``squeue --json`` / ``sacct --json`` output, if listed."""
        r = self._run(*cmd, "--json", "--jobs", jid)
        if r.returncode != 0:
            return None
        try:
            jobs = json.loads(r.stdout).get("jobs") or []
        except json.JSONDecodeError:
            return None
        return next((j for j in jobs if str(j.get("job_id")) == jid), None)

    def _squeue(self, jid: str) -> EngineStatus | None:
        job = self._json_job(jid, "squeue")
        if job is None:
            return None
        return slurm_state(
            _state_text(job.get("job_state")),
            job.get("state_reason"),
            _exit_text(job.get("exit_code")),
        )

    def _scontrol(self, jid: str) -> EngineStatus | None:
        r = self._run("scontrol", "show", "job", jid)
        m = re.search(r"\bJobState=(\S+)", r.stdout) if r.returncode == 0 else None
        if m is None:
            return None
        reason = re.search(r"\bReason=(\S+)", r.stdout)
        code = re.search(r"\bExitCode=(\S+)", r.stdout)
        return slurm_state(m.group(1), reason and reason.group(1), code and code.group(1))

    def _sacct(self, jid: str) -> EngineStatus | None:
        job = self._json_job(jid, "sacct")
        if job is None:
            return None
        state = job.get("state", {})
        text = state.get("current") if isinstance(state, dict) else state
        return slurm_state(_state_text(text), None, _exit_text(job.get("exit_code")))

    def cancel(self, handle: Handle, force: bool = False) -> None:
        args = ["--signal=KILL", "--full"] if force else []
        r = self._run("scancel", *args, handle["slurm_job_id"])
        if r.returncode != 0:
            raise LauncherError(f"scancel failed: {r.stderr.strip()}")

    def logs(self, handle: Handle, offset: int, limit: int) -> tuple[bytes, int]:
        return read_log(handle["log"], offset, limit)


def _state_text(state: Any) -> str:
    if isinstance(state, list):  # Slurm >= 23.02 reports a list of flags
        return " ".join(str(s) for s in state)
    return str(state or "")


def _exit_text(code: Any) -> str | None:
    if isinstance(code, dict):  # Slurm >= 23.02: {"status": [...], "return_code": {...}}
        rc = code.get("return_code")
        return str(rc.get("number") if isinstance(rc, dict) else rc)
    return None if code in (None, 0) else str(code)
