"""``/v1/watches``: convert each newly committed step of a training root (see
:mod:`reshard_server.watches`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Request, status

from reshard_server.admission import Refused
from reshard_server.api.deps import SettingsDep, StoreDep, audit, require, visible_or_404
from reshard_server.auth import Principal
from reshard_server.db import WatchExists, WatchRow
from reshard_server.schemas import WatchCreate, WatchList, WatchPublic
from reshard_server.watches import baseline, check_watch, public_fields
from reshard_svc.errors import ReshardError

router = APIRouter(prefix="/v1/watches", tags=["watches"])
Reader = Annotated[Principal, require("read")]


def to_public(watch: WatchRow, store: StoreDep) -> WatchPublic:
    return WatchPublic(**public_fields(watch, store))


def _watch_or_404(store: StoreDep, watch_id: str, who: Principal) -> WatchRow:
    return visible_or_404(store.get_watch(watch_id), who, "watch", watch_id)  # type: ignore[no-any-return]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=WatchPublic)
def create_watch(
    spec: WatchCreate,
    settings: SettingsDep,
    store: StoreDep,
    request: Request,
    who: Annotated[Principal, require("submit")],
) -> WatchPublic:
    """Start watching ``root``. The steps committed now are left alone (unless
    ``existing``); every step committed from now on whose number is a multiple of
    ``every`` becomes one job. Another active watch of the same root and target is a 409."""
    try:
        spec = check_watch(spec, settings, who)
        skip = baseline(spec)
    except Refused as e:
        audit(request, who, "watch", spec.root, "refused", e.status, e.detail)
        raise HTTPException(e.status, e.detail) from None
    except (ReshardError, OSError, ValueError) as e:  # the root cannot be listed
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_ENTITY, f"cannot list {spec.root}: {e}"
        ) from None
    try:
        watch = store.create_watch(
            spec.model_dump(mode="json", exclude_none=True), skip, owner=who.name
        )
    except WatchExists as e:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"watch {e.watch_id} already converts {spec.root} to {spec.target}; "
            f"`reshard unwatch {e.watch_id}` stops it",
        ) from None
    audit(request, who, "watch", f"watch {watch.id}: {spec.root}", "ok")
    return to_public(watch, store)


@router.get("", response_model=WatchList)
def list_watches(store: StoreDep, who: Reader, all: bool = False) -> WatchList:
    """Active watches (``all``: stopped ones too), oldest first: the caller's own (an
    admin's: everyone's)."""
    rows = store.watches() if all else store.watches("active")
    mine = [w for w in rows if who.admin or w.owner == who.name]
    return WatchList(items=[to_public(w, store) for w in mine])


@router.get("/{watch_id}", response_model=WatchPublic)
def get_watch(store: StoreDep, who: Reader, watch_id: str) -> WatchPublic:
    return to_public(_watch_or_404(store, watch_id, who), store)


@router.delete("/{watch_id}", response_model=WatchPublic)
def stop_watch(
    store: StoreDep,
    request: Request,
    who: Annotated[Principal, require("cancel")],
    watch_id: str,
) -> WatchPublic:
    """Stop a watch: no new jobs; the jobs it submitted run on (``reshard cancel`` them)."""
    visible_or_404(store.get_watch(watch_id), who, "watch", watch_id, request, "unwatch")
    store.stop_watch(watch_id)
    audit(request, who, "unwatch", f"watch {watch_id}", "ok")
    return to_public(_watch_or_404(store, watch_id, who), store)
