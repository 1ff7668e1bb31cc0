"""Watches: the server converts each newly committed step of a training root.

A watch names a root of step folders (``step-N``, ``step_N``, ``iter_N``,
``global_step_N``, ``checkpoint-N``: torchtitan's, torch_checkpointing's, Megatron's,
verl's and HF Trainer's names, and the ``CheckpointManager``'s ``step-%010d``), an
``every``, and a conversion whose target holds ``{step}``. One thread scans every active
watch each ``watch_interval_s``. A step folder counts once it is committed, known by the
file its writer puts there last:

* ``reshard.index.json``: reshard_svc (the index is the commit);
* ``.metadata``: torch DCP (written by the coordinator after every rank's data);
* ``metadata.pkl``: torch_checkpointing (its folder is renamed into place whole).

A half-written step is looked at again on the next scan, never converted. Each committed
step gets at most one job: the job's idempotency key is ``watch:<id>:<step>`` and the step
is recorded (``watch_steps``) once its job exists, so a server killed between the two
finds that job again instead of making a second, and steps committed while it was down
are converted when it is back. A full queue leaves the rest of the steps to the next scan;
any other refusal (a target outside the roots) is recorded on the step, with its reason.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Collection
from typing import Any

from reshard_server.admission import Refused, check_paths
from reshard_server.auth import Principal
from reshard_server.config import Settings
from reshard_server.db import JobRow, JobStore, WatchRow
from reshard_server.schemas import JobCreate, WatchCreate
from reshard_server.ticker import Ticker
from reshard_svc.storage import open_storage

__all__ = ["COMMIT_MARKERS", "STEP_FOLDER", "Watcher", "check_watch", "committed_steps"]

logger = logging.getLogger(__name__)

STEP_FOLDER = re.compile(r"(?:step|iter|global_step|checkpoint)[-_]?(\d{1,18})")
#: (format, the file its writer commits with)
COMMIT_MARKERS = (
    ("reshard", "reshard.index.json"),
    ("torch-dcp", ".metadata"),
    ("torch_checkpointing", "metadata.pkl"),
)

#: submit a watch's job: (spec, idempotency key, the watch's owner) -> the job
Admit = Callable[[JobCreate, str, str], JobRow]


def step_folders(root: str) -> dict[int, str]:
    """Step number -> folder name under ``root``. Two names for one number (``step-5``
    and ``step_5``) are ambiguous: neither is taken, with a warning."""
    seen: dict[int, list[str]] = {}
    for name in open_storage(root).listdir():
        m = STEP_FOLDER.fullmatch(name)
        if m is not None:
            seen.setdefault(int(m.group(1)), []).append(name)
    for step, names in seen.items():
        if len(names) > 1:
            logger.warning(
                "%s: step %d has %d folders (%s): skipped", root, step, len(names), ", ".join(names)
            )
    return {step: names[0] for step, names in seen.items() if len(names) == 1}


def committed_format(source: str) -> str | None:
    """The format of the committed checkpoint at ``source``, or None (not committed)."""
    storage = open_storage(source)
    for fmt, marker in COMMIT_MARKERS:
        if storage.exists(marker):
            return fmt
    return None


def committed_steps(root: str, skip: Collection[int] = (), every: int = 1) -> dict[int, str]:
    """Committed step -> its URI, for the steps divisible by ``every`` not in ``skip``."""
    root = root.rstrip("/")
    out = {}
    for step, name in sorted(step_folders(root).items()):
        if step in skip or step % every:
            continue
        if committed_format(f"{root}/{name}") is not None:
            out[step] = f"{root}/{name}"
    return out


def check_watch(spec: WatchCreate, settings: Settings, who: Principal | None = None) -> WatchCreate:
    """The watch with its root normalised, if its root is readable and its jobs' targets
    writable under the server's roots and the caller's (:class:`Refused` otherwise)."""
    root, target = check_paths(spec.root, spec.target_for(0), settings, who)
    parent, _, name = target.rstrip("/").rpartition("/")
    if parent == root.rstrip("/") and STEP_FOLDER.fullmatch(name):
        raise Refused(
            422,
            f"target {spec.target!r} would write step folders into the watched root: each "
            "export would look like a new step; put the exports beside the root",
        )
    return spec.model_copy(update={"root": root})


class Watcher(Ticker):
    """Scans the active watches on one thread; submits through ``admit`` (the same checks
    as ``POST /v1/jobs``)."""

    thread_name = "reshard-watcher"

    def __init__(self, settings: Settings, store: JobStore, admit: Admit) -> None:
        super().__init__()
        self.settings, self.store, self.admit = settings, store, admit

    def interval(self) -> float:
        return self.settings.watch_interval_s

    def tick(self) -> None:
        for watch in self.store.watches("active"):
            if self.stopping:
                return
            try:
                self.scan(watch)
            except Exception as e:  # the root unreadable, storage down: next scan retries
                logger.warning(
                    "watch %s: scanning %s failed: %s", watch.id, watch.spec.get("root"), e
                )
                self.store.update_watch(
                    watch.id, error=f"{type(e).__name__}: {e}", last_scan_at=time.time()
                )

    def scan(self, watch: WatchRow) -> None:
        spec = WatchCreate(**watch.spec)
        seen = {s.step for s in self.store.watch_steps(watch.id)}
        for step, source in committed_steps(spec.root, seen, spec.every).items():
            if self.store.get_watch(watch.id).state != "active":  # type: ignore[union-attr]
                return  # stopped meanwhile: nothing more
            try:
                job = self.admit(spec.job(step, source), f"watch:{watch.id}:{step}", watch.owner)
            except Refused as e:
                if e.status == 429:  # the queue is full: the rest next scan
                    logger.info("watch %s: queue full at step %d, retrying", watch.id, step)
                    break
                logger.warning("watch %s: step %d refused: %s", watch.id, step, e.detail)
                self.store.record_step(watch.id, step, source, "refused", detail=e.detail)
                continue
            self.store.record_step(watch.id, step, source, "submitted", job_id=job.id)
            logger.info("watch %s: step %d -> job %s", watch.id, step, job.id)
        self.store.update_watch(watch.id, error=None, last_scan_at=time.time())


def baseline(spec: WatchCreate) -> dict[int, str]:
    """The steps a new watch leaves alone: those committed now (none with ``existing``)."""
    return {} if spec.existing else committed_steps(spec.root)


def public_fields(watch: WatchRow, store: JobStore) -> dict[str, Any]:
    """A watch as ``WatchPublic``'s fields."""
    from datetime import UTC, datetime

    def ts(t: float | None) -> datetime | None:
        return datetime.fromtimestamp(t, tz=UTC) if t else None

    spec = WatchCreate(**watch.spec)
    steps = [
        {
            "step": s.step,
            "source": s.source,
            "outcome": s.outcome,
            "job_id": s.job_id,
            "detail": s.detail,
            "at": ts(s.at),
        }
        for s in store.watch_steps(watch.id, limit=100)
    ]
    return {
        "id": watch.id,
        "owner": watch.owner,
        "state": watch.state,
        "spec": spec,
        "root": spec.root,
        "target": spec.target,
        "every": spec.every,
        "submitted": store.count_submitted(watch.id),
        "steps": steps,
        "error": watch.error,
        "created_at": ts(watch.created_at),
        "last_scan_at": ts(watch.last_scan_at),
        "stopped_at": ts(watch.stopped_at),
    }
