"""``/v1/jobs``: submit, list, get, cancel, logs and server-sent progress events."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, status
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from reshard_server.admission import Refused, admit
from reshard_server.api.deps import (
    ManagerDep,
    SettingsDep,
    StoreDep,
    audit,
    require,
    visible_or_404,
)
from reshard_server.auth import Principal
from reshard_server.db import JobRow
from reshard_server.jobs import token_hash
from reshard_server.schemas import JobCreate, JobList, JobLogs, JobPublic, JobState, ProgressPublic
from reshard_svc.errors import UsageError
from reshard_svc.jobs.events import check_event

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
Reader = Annotated[Principal, require("read")]
Submitter = Annotated[Principal, require("submit")]
Canceller = Annotated[Principal, require("cancel")]

MAX_LOG_CHUNK = 1024 * 1024


def _ts(t: float | None) -> datetime | None:
    return datetime.fromtimestamp(t, tz=UTC) if t else None


def to_public(job: JobRow) -> JobPublic:
    progress = ProgressPublic(
        **{k: int(v) for k, v in job.progress.items() if k in ProgressPublic.model_fields}
    )
    throughput = None
    if job.started_at and progress.bytes_done:
        elapsed = (job.finished_at or time.time()) - job.started_at
        throughput = progress.bytes_done / elapsed if elapsed > 0 else None
    return JobPublic(
        id=job.id,
        owner=job.owner,
        state=JobState(job.state),
        spec=JobCreate(**job.spec),
        source=job.spec["source"],
        target=job.spec["target"],
        progress=progress,
        throughput_bytes_per_s=throughput,
        error=job.error,
        reason=job.reason if job.state == "queued" else None,
        attempts=job.attempts,
        engine=job.engine,
        handle=job.handle,
        created_at=_ts(job.created_at),  # type: ignore[arg-type]
        started_at=_ts(job.started_at),
        finished_at=_ts(job.finished_at),
    )


def _job_or_404(store: StoreDep, job_id: str, who: Principal) -> JobRow:
    """The job, if ``who`` may see it (their own, or any for an admin); else 404, the same
    answer as for a job that does not exist."""
    return visible_or_404(store.get(job_id), who, "job", job_id)  # type: ignore[no-any-return]


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobPublic)
def submit(
    spec: JobCreate,
    settings: SettingsDep,
    store: StoreDep,
    manager: ManagerDep,
    request: Request,
    who: Submitter,
    idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
) -> JSONResponse:
    """Queue a conversion. The job is in the database before this replies 202.

    With an ``Idempotency-Key`` already used for the same spec, the existing job is
    returned (200); used for a different spec, 409.
    """
    what = f"{spec.source} -> {spec.target}"
    try:
        job, created = admit(
            spec, settings, store, manager.launcher.max_nodes, idempotency_key, who
        )
    except Refused as e:
        audit(request, who, "submit", what, "refused", e.status, e.detail)
        raise HTTPException(e.status, e.detail, headers=e.headers) from None
    audit(request, who, "submit", f"job {job.id}: {what}", "ok" if created else "existing")
    code = status.HTTP_202_ACCEPTED if created else status.HTTP_200_OK
    return JSONResponse(to_public(job).model_dump(mode="json"), status_code=code)


@router.get("", response_model=JobList)
def list_jobs(
    store: StoreDep,
    who: Reader,
    state: JobState | None = None,
    owner: Annotated[str | None, Query(max_length=200, description="admins: one user's")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> JobList:
    """Jobs newest first: the caller's own (an admin's: everyone's, or ``owner``'s)."""
    if not who.admin:
        owner = who.name
    rows, total = store.list(state.value if state else None, limit, offset, owner)
    return JobList(items=[to_public(r) for r in rows], total=total, limit=limit, offset=offset)


@router.get("/{job_id}", response_model=JobPublic)
def get_job(store: StoreDep, who: Reader, job_id: str) -> JobPublic:
    return to_public(_job_or_404(store, job_id, who))


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(
    store: StoreDep, manager: ManagerDep, request: Request, who: Canceller, job_id: str
) -> JobPublic:
    """Cancel: a queued job at once; a running one gets SIGTERM, SIGKILL after the grace."""
    visible_or_404(store.get(job_id), who, "job", job_id, request, "cancel")
    job = manager.cancel(job_id)
    audit(request, who, "cancel", f"job {job_id}", "ok")
    return to_public(job)  # type: ignore[arg-type]


@router.get("/{job_id}/logs", response_model=JobLogs)
def job_logs(
    store: StoreDep,
    manager: ManagerDep,
    who: Reader,
    job_id: str,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="last N lines")] = None,
) -> JobLogs:
    """The workers' output, from the engine (a local file, Slurm's --output, pod logs)."""
    job = _job_or_404(store, job_id, who)
    if not job.handle:
        return JobLogs(id=job_id, offset=0, next_offset=0, size=0, text="")
    try:
        if tail is not None:
            _, size = manager.launcher.logs(job.handle, 0, 0)
            start = max(0, size - MAX_LOG_CHUNK)
            data, size = manager.launcher.logs(job.handle, start, MAX_LOG_CHUNK)
            text = "".join(data.decode(errors="replace").splitlines(keepends=True)[-tail:])
            return JobLogs(
                id=job_id, offset=size - len(text.encode()), next_offset=size, size=size, text=text
            )
        data, size = manager.launcher.logs(job.handle, offset, MAX_LOG_CHUNK)
    except Exception as e:
        raise HTTPException(status.HTTP_502_BAD_GATEWAY, f"cannot read the job's logs: {e}") from e
    start = min(offset, size)
    return JobLogs(
        id=job_id,
        offset=start,
        next_offset=start + len(data),
        size=size,
        text=data.decode(errors="replace"),
    )


@router.get("/{job_id}/events", response_class=StreamingResponse)
async def job_events(
    store: StoreDep, request: Request, who: Reader, job_id: str
) -> StreamingResponse:
    """Server-sent events: ``progress`` whenever it changes, then one ``state`` at the end."""
    _job_or_404(store, job_id, who)
    interval = request.app.state.settings.poll_interval_s

    async def stream() -> AsyncIterator[str]:
        last = None
        beat = time.monotonic()
        while True:
            job = store.get(job_id)
            if job is None:
                return
            public = to_public(job)
            snapshot = (public.state, public.progress)
            if snapshot != last:
                last = snapshot
                yield f"event: progress\ndata: {public.model_dump_json()}\n\n"
                beat = time.monotonic()
            if public.state.terminal:
                yield f"event: state\ndata: {public.model_dump_json()}\n\n"
                return
            if time.monotonic() - beat > 15:
                yield ": keep-alive\n\n"
                beat = time.monotonic()
            if await request.is_disconnected():
                return
            await asyncio.sleep(interval)

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


# ---------------------------------------------------------------- worker callbacks

callbacks = APIRouter(prefix="/v1/jobs", tags=["callbacks"])
_worker_bearer = HTTPBearer(auto_error=False)


@callbacks.post("/{job_id}/events", status_code=status.HTTP_204_NO_CONTENT)
def post_event(
    store: StoreDep,
    manager: ManagerDep,
    job_id: str,
    event: dict[str, Any],
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_worker_bearer)],
) -> None:
    """Rank 0 of a job reports ``progress``, ``done`` or ``error``.

    Authenticated by the job's own callback token (``RESHARD_CALLBACK_TOKEN``), never the
    API token: 401 for an unknown token, 403 for another job's.
    """
    given = creds.credentials if creds and creds.scheme.lower() == "bearer" else ""
    owner = store.by_token_hash(token_hash(given)) if given else None
    if owner is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or unknown job token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(owner, job_id):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this token belongs to another job")
    try:
        checked = check_event(event)
    except UsageError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(e)) from None
    manager.on_event(job_id, checked)
