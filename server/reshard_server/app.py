"""``create_app(settings)``: the FastAPI application factory."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reshard_server.admission import admit
from reshard_server.api.routes import checkpoints, health, jobs, plans, watches
from reshard_server.config import Settings
from reshard_server.db import JobRow, JobStore, ServerLock
from reshard_server.jobs import JobManager
from reshard_server.launcher import Launcher, make_launcher
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
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
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
        manager.start()  # re-attaches earlier jobs in the background

        def admit_for_watch(spec: JobCreate, key: str) -> JobRow:
            return admit(spec, settings, store, manager.launcher.max_nodes, key)[0]

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
    app.state.metrics = Metrics(app.state)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(jobs.callbacks)
    app.include_router(checkpoints.router)
    app.include_router(watches.router)
    app.include_router(plans.router)
    app.add_middleware(CountRequests, metrics=app.state.metrics)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
