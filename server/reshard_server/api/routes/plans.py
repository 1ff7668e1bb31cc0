"""``/v1/plans``: a dry run (``reshard plan``) on the server, for a source under its roots."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, HTTPException, status

from reshard_server.api.deps import AuthDep, SettingsDep
from reshard_server.paths import check_uri, relative_path
from reshard_server.schemas import PlanCreate
from reshard_svc.errors import PathNotAllowedError, ReshardError

router = APIRouter(prefix="/v1/plans", tags=["plans"], dependencies=[AuthDep])


@router.post("")
def create_plan(body: PlanCreate, settings: SettingsDep) -> dict[str, Any]:
    """Plan the conversion (or load) for ``world`` workers and return what each would read,
    send, receive and hold in flight; reads the source's index only, writes nothing."""
    from reshard_svc.runtime.dry_run import dry_run

    if relative_path(body.source):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY,
                            f"source {body.source!r} is a relative path: give an absolute one")  # fmt: skip
    try:
        source = check_uri(body.source, settings.roots, what="source")
    except PathNotAllowedError as e:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(e)) from None
    spec = replace(body.to_spec(), source=source)
    try:
        return dry_run(spec, body.world, load=body.load).to_json()
    except ReshardError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(e)) from None
