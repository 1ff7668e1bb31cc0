"""Admitting a job: the checks every submission passes, from ``POST /v1/jobs`` or a watch.

:func:`admit` checks where a job reads and writes (under the operator's roots), what it
asks for (workers, nodes) and the queue, then stores it queued. A refusal is a
:class:`Refused` carrying the HTTP status and the message that names what to fix.
"""

from __future__ import annotations

import hashlib
import json

from reshard_server.auth import Principal
from reshard_server.config import Settings
from reshard_server.db import JobRow, JobStore, QueueFull
from reshard_server.paths import check_uri, relative_path
from reshard_server.schemas import JobCreate
from reshard_svc.errors import PathNotAllowedError

__all__ = ["Refused", "admit", "check_paths", "check_readable"]


class Refused(Exception):
    """A submission the server will not take: ``status`` (403, 409, 422, 429) and why."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        self.status, self.detail, self.headers = status, detail, headers
        super().__init__(detail)


def check_paths(
    source: str, target: str, settings: Settings, who: Principal | None = None
) -> tuple[str, str]:
    """The normalised (source, target) when both lie under the server's roots and the
    caller's own (the target strictly below one) and differ; :class:`Refused` otherwise."""
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
    if who is not None and who.roots is not None:
        for what, uri in (("source", source), ("target", target)):
            try:
                check_uri(uri, list(who.roots), what=what, write=what == "target")
            except PathNotAllowedError:
                raise Refused(
                    403,
                    f"{what} {uri!r} is outside user {who.name!r}'s roots "
                    f"({', '.join(who.roots) or 'none'})",
                ) from None
    if source.rstrip("/") == target.rstrip("/"):
        raise Refused(422, "target must differ from source")
    return source, target


def check_readable(uri: str, settings: Settings, who: Principal, what: str = "uri") -> str:
    """``uri`` normalised when it lies under the server's roots and the caller's own (a
    plan's source, a checkpoint to inspect); :class:`Refused` (403) otherwise."""
    if relative_path(uri):
        raise Refused(422, f"{what} {uri!r} is a relative path: give an absolute one")
    try:
        norm = check_uri(uri, settings.roots, what=what)
        if who.roots is not None:
            try:
                check_uri(norm, list(who.roots), what=what)
            except PathNotAllowedError:
                raise PathNotAllowedError(
                    f"{what} {uri!r} is outside user {who.name!r}'s roots "
                    f"({', '.join(who.roots) or 'none'})"
                ) from None
    except PathNotAllowedError as e:
        raise Refused(403, str(e)) from None
    return norm


def admit(
    spec: JobCreate,
    settings: Settings,
    store: JobStore,
    max_nodes: int,
    idem_key: str | None,
    who: Principal,
) -> tuple[JobRow, bool]:
    """Store ``spec`` as a queued job of ``who``; returns (job, created). With an
    ``idem_key`` already used for the same spec, that job (created False); for another
    spec, 409. Past the queue's or the user's own limit of queued jobs, 429."""
    source, target = check_paths(spec.source, spec.target, settings, who)
    job_spec = spec.to_spec()
    max_nodes = min(settings.max_nodes, max_nodes)
    for what, value, limit in (
        ("workers", job_spec.workers, settings.max_workers),
        ("nodes", job_spec.nodes, max_nodes),
    ):
        if value > limit:
            hint = " (the local launcher runs one node)" if what == "nodes" else ""
            raise Refused(422, f"{what}={value} exceeds this server's limit of {limit}{hint}")
    body = job_spec.to_json()
    body.update(source=source, target=target)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    if idem_key is not None and not who.admin:
        idem_key = f"{who.name}:{idem_key}"  # users' keys never meet
    try:
        job, created = store.create(
            body,
            idem_key,
            digest if idem_key else None,
            settings.max_queued,
            owner=who.name,
            owner_max_queued=who.max_queued,
        )
    except QueueFull as e:
        raise Refused(429, f"queue is full: {e}", {"Retry-After": "5"}) from None
    if not created and (job.idem_hash != digest or job.owner != who.name):
        raise Refused(409, f"Idempotency-Key already used for job {job.id} with a different spec")
    return job, created
