"""Admitting a job: the checks every submission passes, from ``POST /v1/jobs`` or a watch.

:func:`admit` checks where a job reads and writes (under the operator's roots), what it
asks for (workers, nodes) and the queue, then stores it queued. A refusal is a
:class:`Refused` carrying the HTTP status and the message that names what to fix.
"""

from __future__ import annotations

import hashlib
import json

from reshard_server.config import Settings
from reshard_server.db import JobRow, JobStore, QueueFull
from reshard_server.paths import check_uri, relative_path
from reshard_server.schemas import JobCreate
from reshard_svc.errors import PathNotAllowedError

__all__ = ["Refused", "admit", "check_paths"]


class Refused(Exception):
    """A submission the server will not take: ``status`` (403, 409, 422, 429) and why."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        self.status, self.detail, self.headers = status, detail, headers
        super().__init__(detail)


def check_paths(source: str, target: str, settings: Settings) -> tuple[str, str]:
    """The normalised (source, target) when both lie under the roots (the target strictly
    below one) and differ; :class:`Refused` otherwise."""
    for what, uri in (("source", source), ("target", target)):
        if relative_path(uri):
            raise Refused(
                422,
                f"{what} {uri!r} is a relative path: the server cannot know your working "
                "folder; give an absolute path (the reshard CLI resolves it for you)",
            )
    try:
        source = check_uri(source, settings.roots, what="source")
        target = check_uri(target, settings.roots, what="target", write=True)
    except PathNotAllowedError as e:
        raise Refused(403, str(e)) from None
    if source.rstrip("/") == target.rstrip("/"):
        raise Refused(422, "target must differ from source")
    return source, target


def admit(
    spec: JobCreate, settings: Settings, store: JobStore, max_nodes: int, idem_key: str | None
) -> tuple[JobRow, bool]:
    """Store ``spec`` as a queued job; returns (job, created). With an ``idem_key`` already
    used for the same spec, that job (created False); for another spec, 409."""
    source, target = check_paths(spec.source, spec.target, settings)
    job_spec = spec.to_spec()
    max_nodes = min(settings.max_nodes, max_nodes)
    for what, value, limit in (("workers", job_spec.workers, settings.max_workers),
                               ("nodes", job_spec.nodes, max_nodes)):  # fmt: skip
        if value > limit:
            hint = " (the local launcher runs one node)" if what == "nodes" else ""
            raise Refused(422, f"{what}={value} exceeds this server's limit of {limit}{hint}")
    body = job_spec.to_json()
    body.update(source=source, target=target)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    try:
        job, created = store.create(
            body, idem_key, digest if idem_key else None, settings.max_queued
        )
    except QueueFull as e:
        raise Refused(429, f"queue is full: {e}", {"Retry-After": "5"}) from None
    if not created and job.idem_hash != digest:
        raise Refused(409, f"Idempotency-Key already used for job {job.id} with a different spec")
    return job, created
