"""``/v1/audit``: who submitted, cancelled, or was refused what, when, from where (admins)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from reshard_server.api.deps import StoreDep, require
from reshard_server.schemas import AuditEntry, AuditList

router = APIRouter(prefix="/v1/audit", tags=["audit"], dependencies=[require("admin")])


@router.get("", response_model=AuditList)
def audit_log(
    store: StoreDep,
    principal: Annotated[str | None, Query(max_length=200, description="one user's")] = None,
    before: Annotated[
        int | None, Query(ge=1, le=2**62, description="entries older than this seq")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditList:
    """The audit log, newest first. Tokens never appear in it."""
    rows = store.audit_log(limit, before, principal)
    return AuditList(
        items=[
            AuditEntry(
                seq=r.seq,
                at=datetime.fromtimestamp(r.at, tz=UTC),
                principal=r.principal,
                action=r.action,
                target=r.target,
                outcome=r.outcome,
                code=r.code,
                detail=r.detail,
                address=r.address,
            )
            for r in rows
        ]
    )
