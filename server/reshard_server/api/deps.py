"""Dependencies shared by the routes: settings, store, manager, the caller (bearer-token
auth, :mod:`reshard_server.auth`), scope checks and the audit log."""

from __future__ import annotations

import hmac
import threading
import time
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from reshard_server.auth import ADMIN, AuthFile, JwtVerifier, Principal, looks_like_jwt
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


def authenticate(
    request: Request,
    settings: SettingsDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller, from its bearer token: ``RESHARD_TOKEN`` (compared in constant time) is
    the admin; any other token is looked up, by hash, in ``RESHARD_AUTH_FILE``. 401
    otherwise; the refusal is audited, without the token."""
    given = creds.credentials if creds and creds.scheme.lower() == "bearer" else ""
    if given:
        if settings.token and hmac.compare_digest(given.encode(), settings.token.encode()):
            return Principal(name=ADMIN, scopes=frozenset({ADMIN}), via="shared-token")
        verifier: JwtVerifier | None = request.app.state.jwt
        if verifier is not None and looks_like_jwt(given):
            who = verifier.verify(given)
            if who is not None:
                return who
        auth: AuthFile | None = request.app.state.auth
        if auth is not None:
            who = auth.authenticate(given)
            if who is not None:
                return who
    address = request.client.host if request.client else ""
    if _unthrottled(address):  # a flood of bad tokens does not flood the audit log
        audit(request, None, "authenticate", request.url.path, "refused", 401)
    raise HTTPException(
        status.HTTP_401_UNAUTHORIZED,
        "missing, wrong or revoked bearer token (set RESHARD_TOKEN on the client to a token "
        "the server's operator gave you)",
        headers={"WWW-Authenticate": "Bearer"},
    )


#: refused tokens are audited at most once per address per this many seconds
REFUSAL_AUDIT_INTERVAL_S = 10.0
_last_refusal: dict[str, float] = {}
_refusal_lock = threading.Lock()


def _unthrottled(address: str) -> bool:
    now = time.monotonic()
    with _refusal_lock:
        if now - _last_refusal.get(address, -1e9) < REFUSAL_AUDIT_INTERVAL_S:
            return False
        if len(_last_refusal) > 10_000:  # forget old addresses, bounded memory
            _last_refusal.clear()
        _last_refusal[address] = now
        return True


PrincipalDep = Annotated[Principal, Depends(authenticate)]
AuthDep = Depends(authenticate)


def require(scope: str) -> Any:
    """A dependency: the caller, who must hold ``scope`` (403 naming it otherwise)."""

    def check(request: Request, who: PrincipalDep) -> Principal:
        if not who.may(scope):
            audit(request, who, f"need:{scope}", request.url.path, "refused", 403)
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"user {who.name!r} lacks the {scope!r} scope (ask the server's operator)",
            )
        return who

    return Depends(check)


def audit(
    request: Request,
    who: Principal | None,
    action: str,
    target: str,
    outcome: str,
    code: int = 0,
    detail: str = "",
) -> None:
    """One line of the audit log: who did what to which target, and how it went."""
    store: JobStore | None = getattr(request.app.state, "store", None)
    if store is None:
        return
    address = request.client.host if request.client else ""
    store.audit(who.name if who else "", action, target, outcome, code, detail, address)


def visible_or_404(
    row: Any,
    who: Principal,
    what: str,
    ident: str,
    request: Request | None = None,
    action: str = "",
) -> Any:
    """``row`` (a job or watch) if ``who`` may see it: their own, or any for an admin.
    Otherwise 404, the same answer as for one that does not exist (audited as a refused
    ``action`` when given)."""
    if row is None or not (who.admin or row.owner == who.name):
        if request is not None and action:
            audit(request, who, action, f"{what} {ident}", "refused", 404)
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no {what} {ident!r}")
    return row
