"""``/healthz`` (no auth) and ``/metrics`` (Prometheus text, auth)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from reshard_server.api.deps import PrincipalDep, require

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(request: Request) -> dict[str, object]:
    counts = request.app.state.store.counts()
    return {"status": "ok", "jobs": counts}


@router.get("/metrics", dependencies=[require("read")])
def metrics(request: Request) -> Response:
    return Response(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


@router.get("/v1/me")
def me(who: PrincipalDep) -> dict[str, object]:
    """Who the token is: user, scopes, roots (null: every server root), quotas."""
    return {
        "name": who.name,
        "scopes": sorted(who.scopes),
        "roots": who.roots,
        "max_running": who.max_running,
        "max_queued": who.max_queued,
        "via": who.via,
    }
