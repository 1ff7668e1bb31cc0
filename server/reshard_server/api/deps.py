"""Dependencies shared by the routes: settings, store, manager, and bearer-token auth."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from reshard_server.config import Settings
from reshard_server.db import JobStore
from reshard_server.jobs import JobManager

_bearer = HTTPBearer(auto_error=False)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def get_store(request: Request) -> JobStore:
    return request.app.state.store  # type: ignore[no-any-return]


def get_manager(request: Request) -> JobManager:
    return request.app.state.manager  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[JobStore, Depends(get_store)]
ManagerDep = Annotated[JobManager, Depends(get_manager)]


def require_token(
    settings: SettingsDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Bearer-token check, in constant time. An empty RESHARD_TOKEN refuses everyone."""
    given = creds.credentials.encode() if creds and creds.scheme.lower() == "bearer" else b""
    expected = settings.token.encode()
    if not expected or not hmac.compare_digest(given, expected):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong bearer token (set RESHARD_TOKEN on the client)",
            headers={"WWW-Authenticate": "Bearer"},
        )


AuthDep = Depends(require_token)
