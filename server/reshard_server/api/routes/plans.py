"""``/v1/plans``: a dry run (``reshard plan``) on the server, for a source under its roots."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, status

from reshard_server.admission import Refused, check_readable
from reshard_server.api.deps import SettingsDep, require
from reshard_server.auth import Principal
from reshard_server.schemas import PlanCreate
from reshard_svc.errors import ReshardError

router = APIRouter(prefix="/v1/plans", tags=["plans"])


@router.post("")
def create_plan(
    body: PlanCreate, settings: SettingsDep, who: Annotated[Principal, require("read")]
) -> dict[str, Any]:
    """Plan the conversion (or load) for ``world`` workers and return what each would read,
    send, receive and hold in flight; reads the source's index only, writes nothing."""
    from reshard_svc.runtime.dry_run import dry_run

    try:
        source = check_readable(body.source, settings, who, "source")
    except Refused as e:
        raise HTTPException(e.status, e.detail) from None
    spec = replace(body.to_spec(), source=source)
    try:
        return dry_run(spec, body.world, load=body.load).to_json()
    except ReshardError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(e)) from None
