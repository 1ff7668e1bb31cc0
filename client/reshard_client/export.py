"""Export a training job's checkpoints as they commit, on a reshard-server, off the
training job: :class:`ExportOnCommit` is a ``CheckpointManager(on_commit=...)`` hook."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from reshard_client.client import ReshardClient
from reshard_client.errors import ReshardClientError

__all__ = ["ExportOnCommit"]

logger = logging.getLogger(__name__)

_DONE = ("succeeded", "failed", "cancelled")


class ExportOnCommit:
    """Submit one conversion job per ``every``-th committed step to a reshard-server.

    ``target`` is a template for the job's target (``/exports/hf-step-{step}``); ``spec``
    holds the other job fields (``{"format": "hf", "dtype": "bf16"}``). Each job's
    idempotency key is the step's URI, so a retried or repeated submission makes no second
    job. Training never waits for an export and never fails because of one: a submission
    that fails is a warning. Until its job ends, a step is held from retention
    (:meth:`holds`).
    """

    def __init__(
        self,
        target: str,
        *,
        every: int = 1,
        spec: Mapping[str, Any] | None = None,
        url: str | None = None,
        token: str | None = None,
        client: ReshardClient | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if "{step" not in target:
            raise ValueError(
                f"target {target!r} needs a {{step}} field, e.g. /exports/step-{{step}}"
            )
        self.target, self.every, self.spec = target, every, dict(spec or {})
        for key in ("source", "target"):
            if key in self.spec:
                raise ValueError(f"spec must not set {key!r}: the manager gives it per step")
        self.client = client or ReshardClient(url, token)
        self.jobs: dict[int, str] = {}  # step -> job id, for every export submitted
        self._ended: set[int] = set()  # steps whose job has ended: no longer held
        self._lock = threading.Lock()

    def __call__(self, step: int, uri: str) -> None:
        if step % self.every:
            return
        body = {**self.spec, "source": uri, "target": self.target.format(step=step)}
        try:
            job = self.client.submit(body, idempotency_key=uri)
        except ReshardClientError as e:
            logger.warning("export of step %d (%s) was not submitted: %s", step, uri, e)
            return
        with self._lock:
            self.jobs[step] = job.id
        logger.info("export of step %d submitted as job %s", step, job.id)

    def holds(self) -> set[int]:
        """Steps whose export job has not ended (or whose state cannot be read now)."""
        with self._lock:
            pending = {s: j for s, j in self.jobs.items() if s not in self._ended}
        held = set()
        for step, job_id in pending.items():
            try:
                state = self.client.get(job_id).state.value
            except ReshardClientError:
                held.add(step)
                continue
            if state in _DONE:
                with self._lock:
                    self._ended.add(step)
            else:
                held.add(step)
        return held
