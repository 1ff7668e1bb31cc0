"""``create_app(settings)``: the FastAPI application factory."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reshard_server.admission import Refused, admit
from reshard_server.api.routes import audit, checkpoints, health, jobs, plans, ui, watches
from reshard_server.auth import AuthFile, Principal, jwt_verifier, owner_principal
from reshard_server.config import Settings
from reshard_server.db import JobRow, JobStore, ServerLock
from reshard_server.jobs import JobManager
from reshard_server.launchers import Launcher, make_launcher
from reshard_server.metrics import Metrics
from reshard_server.schemas import JobCreate
from reshard_server.watches import Watcher
from reshard_svc._version import __version__

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


class BodyLimit:
    """413 for request bodies over ``limit`` bytes (declared or streamed)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await _too_large(send, self.limit)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return msg

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _too_large(send, self.limit)


class _TooLarge(Exception):
    pass


async def _too_large(send: Send, limit: int) -> None:
    body = f'{{"detail":"request body exceeds {limit} bytes"}}'.encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


class HostGuard:
    """DNS rebinding and cross-site requests: a request whose ``Host`` is not one of the
    server's names is refused (421), and so is a state-changing request (POST, PUT, PATCH,
    DELETE) carrying an ``Origin`` from anywhere else (403). Tools that send no ``Origin``
    (curl, the CLI, workers) are not browsers and pass. ``*`` in ``allowed`` turns the
    Host check off (behind a proxy that checks it). ``/healthz`` answers any Host: probes
    ask by IP."""

    UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})

    def __init__(self, app: ASGIApp, allowed: set[str]) -> None:
        self.app, self.allowed = app, {h.lower() for h in allowed}

    def _ok(self, host: str) -> bool:
        if "*" in self.allowed:
            return True
        host = host.strip().lower()
        if host.startswith("["):  # [::1]:8000
            host = host[1 : host.find("]")] if "]" in host else host
        elif host.count(":") == 1:
            host = host.rsplit(":", 1)[0]
        return host in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get(b"host", "")
        # liveness probes (kubelet) ask by pod IP; /healthz says nothing worth rebinding for
        if not self._ok(host) and scope["path"] != "/healthz":
            return await _refuse(send, 421, f"unknown Host {host!r} (RESHARD_ALLOWED_HOSTS)")
        origin = headers.get(b"origin")
        if origin is not None and scope["method"] in self.UNSAFE:
            parsed = urlsplit(origin)
            if origin == "null" or not parsed.hostname or not self._ok(parsed.hostname):
                return await _refuse(send, 403, f"cross-site request from Origin {origin!r}")
        return await self.app(scope, receive, send)


def allowed_hosts(settings: Settings) -> set[str]:
    """The names the server answers to: loopback, its bind address, the host of
    ``RESHARD_PUBLIC_URL`` (or this machine's name when bound to every address), and
    ``RESHARD_ALLOWED_HOSTS``."""
    hosts = {"localhost", "127.0.0.1", "::1", *settings.allowed_hosts}
    if settings.host not in ("", "0.0.0.0", "::"):
        hosts.add(settings.host)
    base = urlsplit(settings.callback_base()).hostname
    if base:
        hosts.add(base)
    return hosts


async def _refuse(send: Send, code: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": code,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


class CountRequests:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                self.metrics.requests.labels(scope["method"], str(msg["status"])).inc()
            await send(msg)

        await self.app(scope, receive, counted)


def create_app(
    settings: Settings | None = None,
    launcher: Launcher | None = None,
    lock: ServerLock | None = None,
) -> FastAPI:
    """Build the app. Jobs persist in ``settings.db``, under the database's lock (``lock``,
    or taken at start-up); workers start through ``launcher``."""
    settings = settings or Settings()
    # Inspecting DCP checkpoints in this process follows the same pickle policy as jobs.
    os.environ["RESHARD_ALLOW_DCP_PICKLE"] = "1" if settings.allow_dcp_pickle else "0"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        held = lock or ServerLock(settings.db)  # before any job is read
        store = JobStore(settings.db)
        manager = JobManager(settings, store, launcher or make_launcher(settings))
        app.state.store, app.state.manager = store, manager

        def running_limit(owner: str) -> int | None:
            who = principal_of(owner) if owner else None
            return who.max_running if who is not None else None

        manager.running_limit = running_limit
        manager.start()  # re-attaches earlier jobs in the background

        def admit_for_watch(spec: JobCreate, key: str, owner: str) -> JobRow:
            who = principal_of(owner)
            if who is None:
                raise Refused(403, f"the watch's owner {owner!r} is no longer a user here")
            return admit(spec, settings, store, manager.launcher.max_nodes, key, who)[0]

        watcher = Watcher(settings, store, admit_for_watch)
        watcher.start()
        try:
            yield
        finally:
            watcher.stop()
            manager.stop()
            store.close()
            held.release()

    # Swagger UI and ReDoc served from the package (fastapi-offline), not a CDN: /docs
    # works on air-gapped clusters.
    app = FastAPIOffline(
        title="reshard-server",
        version=__version__,
        description="Runs checkpoint conversions (reshard_svc.convert) as jobs on torchrun workers.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    auth = AuthFile(settings.auth_file) if settings.auth_file else None
    app.state.auth, app.state.jwt = auth, jwt_verifier(settings)

    def principal_of(name: str) -> Principal | None:
        return owner_principal(name, auth, app.state.jwt)

    app.state.metrics = Metrics(app.state)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(jobs.callbacks)
    app.include_router(checkpoints.router)
    app.include_router(watches.router)
    app.include_router(plans.router)
    app.include_router(audit.router)
    app.include_router(ui.router)
    app.add_middleware(CountRequests, metrics=app.state.metrics)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(HostGuard, allowed=allowed_hosts(settings))
    return app
