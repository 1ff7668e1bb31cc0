"""The job manager: queue -> running -> succeeded | failed | cancelled.

One thread polls every ``poll_interval_s``: it asks the engine (the launcher) about every
job it was given, escalates cancels (SIGTERM, then a kill after the grace period) and
submits queued jobs while fewer than ``max_running`` are at the engine. A job the engine
keeps waiting (Slurm PENDING, a Pending pod) is shown ``queued`` with the engine's reason;
if that reason cannot resolve by itself, the job fails after ``pending_timeout_s``.

The engine's word decides how a job ends: workers exit 0 only after the target is
committed, so a job whose workers were OOM-killed ends ``failed`` with the engine's reason
even if no ``error`` event arrived. Progress and the workers' ``done``/``error`` events
come over HTTP (:meth:`JobManager.on_event`), authenticated by a token minted per job and
attempt; only its sha256 is stored.

On start-up, jobs the database still calls running are re-attached: the engine is asked
about their stored handle. One still pending or running is left to run (nothing is
launched twice); one that ended is concluded as above. A ``lost`` job (local workers die
with the server) whose target is not committed is re-queued up to ``max_retries`` times.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from reshard_server.config import Settings
from reshard_server.db import JobRow, JobStore
from reshard_server.launchers import EngineStatus, Launch, Launcher
from reshard_server.ticker import Ticker
from reshard_svc.jobs.environment import lease_owner
from reshard_svc.jobs.spec import ConvertSpec

__all__ = ["JobManager", "token_hash"]

logger = logging.getLogger(__name__)
PROGRESS_KEYS = ("bytes_done", "bytes_total", "tensors_done", "tensors_total")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def fair_order(waiting: list[JobRow], last_owner: str | None) -> list[JobRow]:
    """Queued jobs in the order they may start: round-robin across their owners (each
    owner's own in submission order), beginning with the owner after ``last_owner``, whose
    job started last; so one user's sixteen jobs do not hold another's one back."""
    queues: dict[str, list[JobRow]] = {}
    for job in waiting:  # oldest first
        queues.setdefault(job.owner, []).append(job)
    owners = sorted(queues)
    if last_owner is not None:
        after = [o for o in owners if o > last_owner]
        owners = after + [o for o in owners if o <= last_owner]
    out: list[JobRow] = []
    for i in range(max((len(q) for q in queues.values()), default=0)):
        out.extend(queues[o][i] for o in owners if i < len(queues[o]))
    return out


class JobManager(Ticker):
    """Owns the job lifecycle, on one long-lived thread (engine calls block; local workers
    are its children and die with it, by ``PR_SET_PDEATHSIG``): it first re-attaches the
    jobs an earlier process left, while the server already answers requests, then polls."""

    thread_name = "reshard-job-manager"

    def __init__(self, settings: Settings, store: JobStore, launcher: Launcher) -> None:
        super().__init__()
        self.settings = settings
        self.store = store
        self.launcher = launcher
        self._cancel_at: dict[str, float] = {}
        self.bytes_converted = 0
        #: a user's own limit of jobs at the engine (None: only the server's)
        self.running_limit: Callable[[str], int | None] = lambda owner: None
        self._last_owner: str | None = None  # whose job started last (round-robin)

    def log_path(self, job_id: str) -> Any:
        return self.settings.log_dir() / f"{job_id}.log"

    # ---- lifecycle (Ticker)

    def interval(self) -> float:
        return self.settings.poll_interval_s

    def first(self) -> None:
        self.reconcile()

    def _at_engine(self) -> list[JobRow]:
        """Jobs handed to the engine and not concluded: running, or kept waiting there."""
        return [j for j in self.store.in_state("queued", "running") if j.at_engine]

    def reconcile(self) -> None:
        """Re-attach the jobs a previous server process left at the engine."""
        for job in self._at_engine():
            status = self._status(job)
            if status.active:
                logger.info("job %s: re-attached (%s on %s)", job.id, status.state, job.engine)
                if job.cancel_requested:
                    self._cancel_running(job)
                continue
            self._conclude(job, status)

    def tick(self) -> None:
        now = time.time()
        for job in self._at_engine():
            status = self._status(job)
            if status.active:
                self._track(job, status, now)
                if job.cancel_requested and job.id not in self._cancel_at:
                    self._cancel_running(job)
                due = self._cancel_at.get(job.id)
                if due is not None and now >= due and job.handle:
                    logger.warning("job %s: still running after the grace period, killing", job.id)
                    self.launcher.cancel(job.handle, force=True)
                    self._cancel_at[job.id] = now + 5
                continue
            self._cancel_at.pop(job.id, None)
            self._conclude(self.store.get(job.id) or job, status)
        at_engine = self._at_engine()
        busy = len(at_engine)
        per_owner = Counter(j.owner for j in at_engine)
        waiting = [j for j in self.store.in_state("queued") if not j.at_engine]
        for job in fair_order(waiting, self._last_owner):
            if busy >= self.settings.max_running:
                break
            limit = self.running_limit(job.owner)
            if limit is not None and per_owner[job.owner] >= limit:
                reason = (
                    f"user {job.owner!r} has {per_owner[job.owner]} jobs running (their "
                    f"max_running is {limit})"
                )
                if job.reason != reason:
                    self.store.update(job.id, reason=reason)
                continue
            self._launch(job)
            busy += 1
            per_owner[job.owner] += 1
            self._last_owner = job.owner

    def _track(self, job: JobRow, status: EngineStatus, now: float) -> None:
        """Show what the engine does with a job: ``queued`` with its reason while it keeps
        the job waiting (failing it when that cannot resolve), ``running`` once it runs."""
        if status.state == "running":
            if job.state != "running" or job.reason:
                self.store.update(job.id, state="running", reason=None, pending_since=None)
            return
        since = job.pending_since or now
        if job.state != "queued" or job.reason != status.reason or not job.pending_since:
            self.store.update(job.id, state="queued", reason=status.reason, pending_since=since)
            logger.info("job %s: the engine keeps it waiting (%s)", job.id, status.reason)
        waited = now - since
        if status.hopeless and waited >= self.settings.pending_timeout_s and job.handle:
            why = (
                f"{status.reason}: the engine cannot start it (the request exceeds what it "
                f"offers); gave up after {waited:.0f} s (RESHARD_PENDING_TIMEOUT_S)"
            )
            try:
                self.launcher.cancel(job.handle, force=True)
            except Exception:
                logger.warning("job %s: could not cancel it at the engine", job.id, exc_info=True)
            self._finish(job, "failed", why)

    def _status(self, job: JobRow) -> EngineStatus:
        if not job.handle:
            return EngineStatus("lost", "the server stopped before the job was submitted")
        try:
            return self.launcher.status(job.handle)
        except Exception as e:  # an engine hiccup: ask again next tick
            logger.warning("job %s: cannot get its status from %s: %s", job.id, job.engine, e)
            return EngineStatus("running")

    def _conclude(self, job: JobRow, status: EngineStatus) -> None:
        """A job the engine no longer runs: succeeded, cancelled, failed or re-queued."""
        final = job.final or {}
        if job.handle and status.state == "lost":
            try:  # local leftovers of a dead server, if any
                self.launcher.cancel(job.handle, force=True)
            except Exception:
                logger.debug("job %s: cleanup after loss failed", job.id, exc_info=True)
        if job.cancel_requested:
            self._finish(job, "cancelled", "cancelled by request")
        elif status.state == "succeeded" or (
            status.state == "lost" and final.get("event") == "done"
        ):
            self._finish(job, "succeeded", None)
        elif status.state == "lost":
            committed = self._target_committed(job)
            if not committed and job.attempts <= self.settings.max_retries:
                logger.info("job %s: re-queued (%s)", job.id, status.reason)
                self.store.update(
                    job.id,
                    state="queued",
                    started_at=None,
                    progress={},
                    error=None,
                    handle=None,
                    final=None,
                    token_hash=None,
                    reason=None,
                    pending_since=None,
                )
            elif committed:
                self._finish(
                    job,
                    "failed",
                    f"{status.reason}; its target is committed but "
                    "the job's completion was not recorded — verify it before use",
                )
            else:
                self._finish(
                    job,
                    "failed",
                    f"{status.reason}; retry limit ({self.settings.max_retries}) reached",
                )
        else:
            reason = final.get("error") or status.reason or "the workers failed"
            if final.get("error") and status.reason:
                reason = f"{final['error']} ({status.reason})"
            self._finish(job, "failed", reason)

    def _target_committed(self, job: JobRow) -> bool:
        try:
            from reshard_svc.format.index import INDEX_NAME
            from reshard_svc.storage import open_storage

            return open_storage(job.spec["target"]).exists(INDEX_NAME)
        except Exception:
            logger.warning("job %s: cannot check its target", job.id, exc_info=True)
            return False

    def _finish(self, job: JobRow, state: str, error: str | None) -> None:
        if state in ("failed", "cancelled"):
            self._collect(job)  # before the state says so: a client may look right away
        self.store.update(
            job.id,
            state=state,
            error=error,
            finished_at=time.time(),
            reason=None,
            pending_since=None,
        )
        if state == "succeeded":
            self.bytes_converted += int(job.progress.get("bytes_total", 0))
        logger.info("job %s: %s%s", job.id, state, f" ({error})" if error else "")

    def _collect(self, job: JobRow) -> None:
        """Remove the staging data of a job whose workers are gone (all its attempts hold
        leases owned by ``reshard-job-<id>``). Another run into the target is untouched."""
        from reshard_svc.format.collect import collect

        try:
            report = collect(job.spec["target"], owner=lease_owner(job.id))
        except Exception:
            logger.warning("job %s: could not collect its staging data", job.id, exc_info=True)
            return
        if report:
            logger.info("job %s: collected %d leftovers", job.id, len(report.removed))

    def _launch(self, job: JobRow) -> None:
        token = secrets.token_urlsafe(32)
        if job.at_engine or not self.store.transition(
            job.id,
            ("queued",),
            state="running",
            started_at=time.time(),
            attempts=job.attempts + 1,
            engine=self.launcher.name,
            handle=None,
            final=None,
            token_hash=token_hash(token),
        ):
            return
        launch = Launch(
            job_id=job.id,
            attempt=job.attempts + 1,
            spec=ConvertSpec.from_json(job.spec),
            env=self.settings.worker_env(),
            log_path=self.log_path(job.id),
            callback_url=f"{self.settings.callback_base()}/v1/jobs/{job.id}/events",
            callback_token=token,
        )
        try:
            handle = self.launcher.submit(launch)
        except Exception as e:
            logger.exception("job %s: could not start", job.id)
            self.store.update(
                job.id,
                state="failed",
                error=f"could not start workers: {e}",
                finished_at=time.time(),
            )
            return
        self.store.update(job.id, handle=handle)

    # ---- requests

    def on_event(self, job_id: str, event: dict[str, Any]) -> None:
        """A checked event from the job's rank 0 (see :func:`reshard_svc.jobs.events.check_event`)."""
        if event["event"] == "progress":
            self.store.update(job_id, progress={k: event[k] for k in PROGRESS_KEYS})
        else:
            job = self.store.get(job_id)
            if job is not None and job.final is None:
                self.store.update(job_id, final=event)

    def cancel(self, job_id: str) -> JobRow | None:
        """Cancel a queued job at once; one at the engine (running, or kept waiting there)
        is stopped through its engine, and ends ``cancelled`` once the engine says so."""
        job = self.store.get(job_id)
        if job is None:
            return None
        if job.at_engine:
            self.store.update(job_id, cancel_requested=1)
            self._cancel_running(job)
        elif job.state == "queued" and self.store.transition(
            job_id,
            ("queued",),
            state="cancelled",
            error="cancelled by request",
            finished_at=time.time(),
        ):
            return self.store.get(job_id)
        return self.store.get(job_id)

    def _cancel_running(self, job: JobRow) -> None:
        job = self.store.get(job.id) or job
        if job.handle:
            self._cancel_at[job.id] = time.time() + self.settings.cancel_grace_s
            try:
                self.launcher.cancel(job.handle)
            except Exception:
                logger.warning("job %s: cancel failed; retrying with force", job.id, exc_info=True)
