"""``/ui``: the dashboard, served from the package (no CDN; works offline).

The page and its two files are static; every piece of data it shows comes from the API
with the bearer token the user logs in with (kept in the browser tab's sessionStorage),
so the dashboard is behind the same auth as the API. Served with a strict
Content-Security-Policy (scripts from this server only) and no framing.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import Response

router = APIRouter(tags=["ui"], include_in_schema=False)

_FILES = {"app.js": "text/javascript", "app.css": "text/css"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return files("reshard_server").joinpath("ui", name).read_bytes()


@router.get("/ui")
def index() -> Response:
    return Response(_read("index.html"), media_type="text/html", headers=_HEADERS)


@router.get("/ui/static/{name}")
def static(name: str) -> Response:
    kind = _FILES.get(name)
    if kind is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no file {name!r}")
    return Response(_read(name), media_type=kind, headers=_HEADERS)
