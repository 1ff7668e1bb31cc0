"""``/v1/watches``: convert each newly committed step of a training root (see
:mod:`reshard_server.watches`)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from reshard_server.admission import Refused
from reshard_server.api.deps import AuthDep, SettingsDep, StoreDep
from reshard_server.db import WatchExists, WatchRow
from reshard_server.schemas import WatchCreate, WatchList, WatchPublic
from reshard_server.watches import baseline, check_watch, public_fields
from reshard_svc.errors import ReshardError

router = APIRouter(prefix="/v1/watches", tags=["watches"], dependencies=[AuthDep])


def to_public(watch: WatchRow, store: StoreDep) -> WatchPublic:
    return WatchPublic(**public_fields(watch, store))


def _watch_or_404(store: StoreDep, watch_id: str) -> WatchRow:
    watch = store.get_watch(watch_id)
    if watch is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no watch {watch_id!r}")
    return watch


@router.post("", status_code=status.HTTP_201_CREATED, response_model=WatchPublic)
def create_watch(spec: WatchCreate, settings: SettingsDep, store: StoreDep) -> WatchPublic:
    """Start watching ``root``. The steps committed now are left alone (unless
    ``existing``); every step committed from now on whose number is a multiple of
    ``every`` becomes one job. Another active watch of the same root and target is a 409."""
    try:
        spec = check_watch(spec, settings)
        skip = baseline(spec)
    except Refused as e:
        raise HTTPException(e.status, e.detail) from None
    except (ReshardError, OSError, ValueError) as e:  # the root cannot be listed
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_ENTITY, f"cannot list {spec.root}: {e}"
        ) from None
    try:
        watch = store.create_watch(spec.model_dump(mode="json", exclude_none=True), skip)
    except WatchExists as e:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"watch {e.watch_id} already converts {spec.root} to {spec.target}; "
            f"`reshard unwatch {e.watch_id}` stops it",
        ) from None
    return to_public(watch, store)


@router.get("", response_model=WatchList)
def list_watches(store: StoreDep, all: bool = False) -> WatchList:
    """Active watches (``all``: stopped ones too), oldest first."""
    rows = store.watches() if all else store.watches("active")
    return WatchList(items=[to_public(w, store) for w in rows])


@router.get("/{watch_id}", response_model=WatchPublic)
def get_watch(store: StoreDep, watch_id: str) -> WatchPublic:
    return to_public(_watch_or_404(store, watch_id), store)


@router.delete("/{watch_id}", response_model=WatchPublic)
def stop_watch(store: StoreDep, watch_id: str) -> WatchPublic:
    """Stop a watch: no new jobs; the jobs it submitted run on (``reshard cancel`` them)."""
    _watch_or_404(store, watch_id)
    store.stop_watch(watch_id)
    return to_public(_watch_or_404(store, watch_id), store)
