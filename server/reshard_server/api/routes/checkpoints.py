"""``/v1/checkpoints``: inspect a checkpoint under the allowed roots."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status
from starlette.concurrency import run_in_threadpool

from reshard_server.admission import Refused, check_readable
from reshard_server.api.deps import SettingsDep, require
from reshard_server.auth import Principal
from reshard_server.config import Settings
from reshard_svc.errors import (
    CheckpointError,
    NotACheckpointError,
    StorageError,
    UnsafePickleError,
)

if TYPE_CHECKING:  # the index module imports torch; the server imports it on first use
    from reshard_svc.format.index import CheckpointIndex

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"])


@router.get("")
async def inspect_checkpoint(
    settings: SettingsDep,
    who: Annotated[Principal, require("read")],
    uri: Annotated[str, Query(min_length=1, max_length=4096)],
) -> dict[str, Any]:
    """Tensors (dtype, shape, layout, chunks), files and extras of a checkpoint."""
    index = await _open(uri, settings, who)
    return await run_in_threadpool(_describe, index, uri)


def _describe(index: CheckpointIndex, uri: str) -> dict[str, Any]:
    from reshard_svc.format.inspection import describe_index

    return describe_index(index, uri)


def _inspect(path: str) -> CheckpointIndex:
    """The index at ``path`` (imports torch on first use: on a worker thread, never on the
    event loop, and only once the roots allowed the path)."""
    from reshard_svc import inspect

    return inspect(path)


async def _open(uri: str, settings: Settings, who: Principal) -> CheckpointIndex:
    """The index of the checkpoint at ``uri``, if ``who`` may read there; else the HTTP
    error that says why (403 outside the roots or an unsafe pickle, 404 not a checkpoint,
    422 a broken one, 502 storage)."""
    try:
        path = check_readable(uri, settings, who)
    except Refused as e:
        raise HTTPException(e.status, e.detail) from None
    try:
        return await run_in_threadpool(_inspect, path)
    except NotACheckpointError as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from None
    except UnsafePickleError as e:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(e)) from None
    except CheckpointError as e:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_ENTITY, f"{type(e).__name__}: {e}"
        ) from None
    except StorageError as e:
        raise HTTPException(status.HTTP_502_BAD_GATEWAY, f"storage error: {e}") from None


@router.get("/layout")
async def checkpoint_layout(
    settings: SettingsDep,
    who: Annotated[Principal, require("read")],
    uri: Annotated[str, Query(min_length=1, max_length=4096)],
    tensor: Annotated[str, Query(min_length=1, max_length=4096)],
    rows: Annotated[int, Query(ge=1, le=256)] = 32,
    cols: Annotated[int, Query(ge=1, le=256)] = 64,
) -> dict[str, Any]:
    """One tensor's layout as a picture's data (what ``reshard inspect --layout`` draws):
    a grid of box indices over dims 0 and 1, and each box with its holders and their mesh
    coordinates."""
    index = await _open(uri, settings, who)
    meta = index.tensors.get(tensor)
    if meta is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no tensor {tensor!r} in {uri}")
    return await run_in_threadpool(_picture, meta, rows, cols)


def _picture(meta: Any, rows: int, cols: int) -> dict[str, Any]:
    from reshard_svc.format.picture import layout_picture

    return layout_picture(meta, rows, cols)
