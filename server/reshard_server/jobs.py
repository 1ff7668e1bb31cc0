"""The job manager: queue -> running -> succeeded | failed | cancelled.

One asyncio task polls every ``poll_interval_s``: it folds workers' progress lines into
the database, reaps finished launches, escalates cancels (SIGTERM, then SIGKILL after the
grace period) and starts queued jobs while fewer than ``max_running`` run.

On start-up, jobs the database still calls running are reconciled: their leftover
processes are killed; a job whose workers reported ``done`` succeeded; a job whose target
is not committed is re-queued up to ``max_retries`` times; otherwise it fails with a
reason. A cancelled or failed job never commits (workers commit last, and die first).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from reshard_server.config import Settings
from reshard_server.db import JobRow, JobStore
from reshard_server.launcher import Launcher

__all__ = ["JobManager"]

logger = logging.getLogger(__name__)


def _last_lines(path: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(newest progress record, final done/error record) of a job's progress file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None, None
    progress = final = None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if rec.get("event") in ("done", "error") and final is None:
            final = rec
        if rec.get("event") == "progress" and progress is None:
            progress = rec
        if progress and final:
            break
    return progress, final


class JobManager:
    """Owns the job lifecycle. Every method runs on the event loop thread."""

    def __init__(self, settings: Settings, store: JobStore, launcher: Launcher) -> None:
        self.settings = settings
        self.store = store
        self.launcher = launcher
        self._cancel_at: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self.bytes_converted = 0

    # ---- paths

    def log_path(self, job_id: str) -> Path:
        return self.settings.log_dir() / f"{job_id}.log"

    def progress_path(self, job_id: str) -> Path:
        return self.settings.log_dir() / f"{job_id}.progress.jsonl"

    # ---- lifecycle

    async def start(self) -> None:
        self.reconcile()
        self._task = asyncio.create_task(self._loop(), name="reshard-job-manager")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        # Leave running jobs 'running': their workers die with us (PDEATHSIG) and the
        # next start-up re-queues them.
        for job in self.store.in_state("running"):
            self.launcher.signal(job.id, signal.SIGTERM)

    async def _loop(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # keep the manager alive; the error is in the server log
                logger.exception("job manager tick failed")
            await asyncio.sleep(self.settings.poll_interval_s)

    def reconcile(self) -> None:
        """Fix up jobs a previous server process left running."""
        for job in self.store.in_state("running"):
            killed = self.launcher.signal(job.id, signal.SIGKILL)
            _, final = _last_lines(self.progress_path(job.id))
            if final and final.get("event") == "done":
                self._finish(job, "succeeded", None, final)
                continue
            if job.cancel_requested:
                self._finish(job, "cancelled", "cancelled (server restarted meanwhile)", None)
                continue
            committed = self._target_committed(job)
            if not committed and job.attempts <= self.settings.max_retries:
                logger.info(
                    "job %s: re-queued after a server restart (%d processes killed)", job.id, killed
                )
                self.store.update(job.id, state="queued", started_at=None, progress={}, error=None)
            else:
                reason = (
                    "server restarted while the job ran; its target is committed but the job's "
                    "completion was not recorded — verify it before use"
                    if committed
                    else f"server restarted while the job ran; retry limit ({self.settings.max_retries}) reached"
                )
                self._finish(job, "failed", reason, None)

    def _target_committed(self, job: JobRow) -> bool:
        try:
            from reshard_svc.index import INDEX_NAME
            from reshard_svc.storage import open_storage

            return open_storage(job.spec["target"]).exists(INDEX_NAME)
        except Exception:
            logger.warning("job %s: cannot check its target", job.id, exc_info=True)
            return False

    def tick(self) -> None:
        now = time.time()
        for job in self.store.in_state("running"):
            self._refresh(job)
            code = self.launcher.exit_code(job.id)
            if code is None:
                due = self._cancel_at.get(job.id)
                if due is not None and now >= due:
                    logger.warning("job %s: still running after the grace period, SIGKILL", job.id)
                    self.launcher.signal(job.id, signal.SIGKILL)
                    self._cancel_at[job.id] = now + 5
                continue
            self.launcher.signal(job.id, signal.SIGKILL)  # stragglers, if any
            self.launcher.forget(job.id)
            self._cancel_at.pop(job.id, None)
            progress, final = _last_lines(self.progress_path(job.id))
            job = self.store.get(job.id) or job
            if job.cancel_requested:
                self._finish(job, "cancelled", "cancelled by request", final)
            elif code == 0 and final and final.get("event") == "done":
                self._finish(job, "succeeded", None, final)
            else:
                error = (final or {}).get(
                    "error"
                ) or f"workers exited with code {code}; see the job's logs"
                self._finish(job, "failed", error, final)
        running = len(self.store.in_state("running"))
        for job in self.store.in_state("queued"):
            if running >= self.settings.max_running:
                break
            self._launch(job)
            running += 1

    def _refresh(self, job: JobRow) -> None:
        progress, _ = _last_lines(self.progress_path(job.id))
        if progress:
            keep = {
                k: progress[k]
                for k in ("bytes_done", "bytes_total", "tensors_done", "tensors_total")
            }
            if keep != job.progress:
                self.store.update(job.id, progress=keep)

    def _finish(
        self, job: JobRow, state: str, error: str | None, final: dict[str, Any] | None
    ) -> None:
        progress, _ = _last_lines(self.progress_path(job.id))
        fields: dict[str, Any] = {"state": state, "error": error, "finished_at": time.time()}
        if progress:
            fields["progress"] = {
                k: progress[k]
                for k in ("bytes_done", "bytes_total", "tensors_done", "tensors_total")
            }
        self.store.update(job.id, **fields)
        if state == "succeeded" and progress:
            self.bytes_converted += int(progress.get("bytes_total", 0))
        logger.info("job %s: %s%s", job.id, state, f" ({error})" if error else "")

    def _argv(self, job: JobRow) -> list[str]:
        spec = job.spec
        argv = ["convert", spec["source"], spec["target"], "--format", spec.get("format", "native"),
                "--strategy", spec.get("strategy", "auto"),
                "--progress-file", str(self.progress_path(job.id))]  # fmt: skip
        if spec.get("mesh"):
            argv += ["--mesh", ",".join(f"{k}={v}" for k, v in spec["mesh"].items())]
        if spec.get("rules"):
            argv += ["--rules", json.dumps(spec["rules"])]
        if spec.get("dtype"):
            argv += ["--dtype", spec["dtype"]]
        if spec.get("max_memory"):
            argv += ["--max-memory", spec["max_memory"]]
        argv += ["--checksum", spec.get("checksum", "crc32c")]
        return argv

    def _launch(self, job: JobRow) -> None:
        if not self.store.transition(
            job.id, ("queued",), state="running", started_at=time.time(), attempts=job.attempts + 1
        ):
            return
        self.progress_path(job.id).unlink(missing_ok=True)
        try:
            self.launcher.start(
                job.id,
                self._argv(job),
                int(job.spec.get("workers", 1)),
                self.log_path(job.id),
                self.settings.worker_env(),
            )
        except Exception as e:
            logger.exception("job %s: could not start", job.id)
            self.store.update(
                job.id,
                state="failed",
                error=f"could not start workers: {e}",
                finished_at=time.time(),
            )

    def cancel(self, job_id: str) -> JobRow | None:
        """Cancel a queued job at once; a running one gets SIGTERM, then SIGKILL later."""
        job = self.store.get(job_id)
        if job is None:
            return None
        if job.state == "queued" and self.store.transition(
            job_id,
            ("queued",),
            state="cancelled",
            error="cancelled by request",
            finished_at=time.time(),
        ):
            return self.store.get(job_id)
        if job.state == "running":
            self.store.update(job_id, cancel_requested=1)
            self.launcher.signal(job_id, signal.SIGTERM)
            self._cancel_at[job_id] = time.time() + self.settings.cancel_grace_s
        return self.store.get(job_id)
