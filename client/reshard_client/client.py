"""``ReshardClient`` and ``AsyncReshardClient``: the control plane over HTTP (httpx).

Both take an injectable ``transport`` (``httpx.MockTransport``, ``httpx.ASGITransport``)
for tests, and default to ``RESHARD_URL`` / ``RESHARD_TOKEN`` from the environment.

One core drives both: :class:`_Api` turns each method's arguments into a :class:`_Call`
(method, path, options, how to read the answer) and :class:`_Waiter` decides when ``wait``
is done; the two classes only send calls, one blocking and one awaiting.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx

from reshard_client.errors import TransportError, error_for
from reshard_server.schemas import (
    AuditList,
    JobCreate,
    JobList,
    JobLogs,
    JobPublic,
    PlanCreate,
    WatchCreate,
    WatchList,
    WatchPublic,
)

__all__ = ["AsyncReshardClient", "ReshardClient", "TERMINAL"]

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
DEFAULT_URL = "http://127.0.0.1:8000"


def _config(url: str | None, token: str | None) -> tuple[str, dict[str, str]]:
    url = url or os.environ.get("RESHARD_URL") or DEFAULT_URL
    token = token if token is not None else os.environ.get("RESHARD_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return url.rstrip("/"), headers


def _check(resp: httpx.Response) -> httpx.Response:
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail", resp.text)
        except (json.JSONDecodeError, AttributeError):
            detail = resp.text
        raise error_for(resp.status_code, detail)
    return resp


def _spec(spec: JobCreate | dict[str, Any]) -> dict[str, Any]:
    model = spec if isinstance(spec, JobCreate) else JobCreate(**spec)
    return model.model_dump(mode="json", exclude_none=True)


class _SSE:
    """Incremental server-sent-events parser: feed lines, get (event, data) when complete."""

    def __init__(self) -> None:
        self.event, self.data = "message", []  # type: tuple[str, list[str]]

    def feed(self, line: str) -> tuple[str, dict[str, Any]] | None:
        if not line:
            out = (self.event, json.loads("\n".join(self.data))) if self.data else None
            self.event, self.data = "message", []
            return out
        if line.startswith("event:"):
            self.event = line[6:].strip()
        elif line.startswith("data:"):
            self.data.append(line[5:].strip())
        return None


R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class _Call(Generic[R]):
    """One request of the API and how to read its answer (an ``R``)."""

    method: str
    path: str
    parse: Callable[[Any], R]
    options: dict[str, Any] = field(default_factory=dict)


class _Api:
    """Every call of the REST API, built from the public methods' arguments."""

    @staticmethod
    def submit(spec: JobCreate | dict[str, Any], idempotency_key: str | None) -> _Call[JobPublic]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return _Call(
            method="POST",
            path="/v1/jobs",
            parse=JobPublic.model_validate,
            options={"json": _spec(spec), "headers": headers},
        )

    @staticmethod
    def get(job_id: str) -> _Call[JobPublic]:
        return _Call(method="GET", path=f"/v1/jobs/{job_id}", parse=JobPublic.model_validate)

    @staticmethod
    def list(
        state: str | None, limit: int, offset: int, owner: str | None = None
    ) -> _Call[JobList]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if state:
            params["state"] = state
        if owner:
            params["owner"] = owner
        return _Call(
            method="GET", path="/v1/jobs", parse=JobList.model_validate, options={"params": params}
        )

    @staticmethod
    def audit(limit: int, principal: str | None, before: int | None) -> _Call[AuditList]:
        params: dict[str, Any] = {"limit": limit}
        if principal:
            params["principal"] = principal
        if before:
            params["before"] = before
        return _Call(
            method="GET",
            path="/v1/audit",
            parse=AuditList.model_validate,
            options={"params": params},
        )

    @staticmethod
    def cancel(job_id: str) -> _Call[JobPublic]:
        return _Call(
            method="POST", path=f"/v1/jobs/{job_id}/cancel", parse=JobPublic.model_validate
        )

    @staticmethod
    def logs(job_id: str, offset: int, tail: int | None) -> _Call[JobLogs]:
        params: dict[str, Any] = {"offset": offset}
        if tail:
            params["tail"] = tail
        return _Call(
            method="GET",
            path=f"/v1/jobs/{job_id}/logs",
            parse=JobLogs.model_validate,
            options={"params": params},
        )

    @staticmethod
    def checkpoint(uri: str) -> _Call[dict[str, Any]]:
        return _Call(
            method="GET", path="/v1/checkpoints", parse=dict, options={"params": {"uri": uri}}
        )

    @staticmethod
    def plan(spec: PlanCreate | dict[str, Any]) -> _Call[dict[str, Any]]:
        model = spec if isinstance(spec, PlanCreate) else PlanCreate(**spec)
        body = model.model_dump(mode="json", exclude_none=True)
        return _Call(method="POST", path="/v1/plans", parse=dict, options={"json": body})

    @staticmethod
    def watch(spec: WatchCreate | dict[str, Any]) -> _Call[WatchPublic]:
        model = spec if isinstance(spec, WatchCreate) else WatchCreate(**spec)
        body = model.model_dump(mode="json", exclude_none=True)
        return _Call(
            method="POST",
            path="/v1/watches",
            parse=WatchPublic.model_validate,
            options={"json": body},
        )

    @staticmethod
    def watches(all: bool) -> _Call[WatchList]:
        return _Call(
            method="GET",
            path="/v1/watches",
            parse=WatchList.model_validate,
            options={"params": {"all": "true"} if all else {}},
        )

    @staticmethod
    def get_watch(watch_id: str) -> _Call[WatchPublic]:
        return _Call(method="GET", path=f"/v1/watches/{watch_id}", parse=WatchPublic.model_validate)

    @staticmethod
    def unwatch(watch_id: str) -> _Call[WatchPublic]:
        return _Call(
            method="DELETE", path=f"/v1/watches/{watch_id}", parse=WatchPublic.model_validate
        )

    @staticmethod
    def events_path(job_id: str) -> str:
        return f"/v1/jobs/{job_id}/events"


class _Waiter:
    """``wait``'s logic: report each poll, stop at a terminal state, time out."""

    def __init__(
        self, job_id: str, timeout: float | None, on_progress: Callable[[JobPublic], None] | None
    ) -> None:
        self.job_id, self.timeout, self.on_progress = job_id, timeout, on_progress
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def done(self, job: JobPublic) -> bool:
        if self.on_progress is not None:
            self.on_progress(job)
        if job.state.value in TERMINAL:
            return True
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeoutError(f"job {self.job_id} still {job.state.value} after {self.timeout} s")
        return False


class ReshardClient:
    """Synchronous client. ``with ReshardClient() as c: c.submit({...})``."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 30.0,
    ) -> None:
        base, headers = _config(url, token)
        self._http = httpx.Client(
            base_url=base, headers=headers, transport=transport, timeout=timeout
        )

    def __enter__(self) -> ReshardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call[R]) -> R:
        try:
            resp = _check(self._http.request(call.method, call.path, **call.options))
        except httpx.TransportError as e:
            raise TransportError(f"cannot reach {self._http.base_url}: {e}") from e
        return call.parse(resp.json())

    def submit(
        self, spec: JobCreate | dict[str, Any], *, idempotency_key: str | None = None
    ) -> JobPublic:
        return self._send(_Api.submit(spec, idempotency_key))

    def get(self, job_id: str) -> JobPublic:
        return self._send(_Api.get(job_id))

    def list(
        self,
        *,
        state: str | None = None,
        limit: int = 50,
        offset: int = 0,
        owner: str | None = None,
    ) -> JobList:
        """Your jobs, newest first (an admin's: everyone's, or ``owner``'s)."""
        return self._send(_Api.list(state, limit, offset, owner))

    def audit(
        self, *, limit: int = 100, principal: str | None = None, before: int | None = None
    ) -> AuditList:
        """The audit log, newest first (admins only)."""
        return self._send(_Api.audit(limit, principal, before))

    def cancel(self, job_id: str) -> JobPublic:
        return self._send(_Api.cancel(job_id))

    def logs(self, job_id: str, *, offset: int = 0, tail: int | None = None) -> JobLogs:
        return self._send(_Api.logs(job_id, offset, tail))

    def checkpoint(self, uri: str) -> dict[str, Any]:
        return self._send(_Api.checkpoint(uri))

    def plan(self, spec: PlanCreate | dict[str, Any]) -> dict[str, Any]:
        """A dry run on the server (``reshard plan``): what each worker would do."""
        return self._send(_Api.plan(spec))

    def watch(self, spec: WatchCreate | dict[str, Any]) -> WatchPublic:
        """Convert each newly committed step of ``spec["root"]`` (see ``WatchCreate``)."""
        return self._send(_Api.watch(spec))

    def watches(self, *, all: bool = False) -> WatchList:
        return self._send(_Api.watches(all))

    def get_watch(self, watch_id: str) -> WatchPublic:
        return self._send(_Api.get_watch(watch_id))

    def unwatch(self, watch_id: str) -> WatchPublic:
        return self._send(_Api.unwatch(watch_id))

    def events(self, job_id: str) -> Iterator[tuple[str, JobPublic]]:
        """Server-sent events until the job ends: ("progress" | "state", job)."""
        try:
            with self._http.stream("GET", _Api.events_path(job_id), timeout=None) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _check(resp)
                parser = _SSE()
                for line in resp.iter_lines():
                    got = parser.feed(line)
                    if got is not None:
                        yield got[0], JobPublic.model_validate(got[1])
        except httpx.TransportError as e:
            raise TransportError(f"event stream broke: {e}") from e

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_progress: Callable[[JobPublic], None] | None = None,
        poll: float = 0.5,
    ) -> JobPublic:
        """Block until the job is succeeded, failed or cancelled; returns the final job."""
        waiter = _Waiter(job_id, timeout, on_progress)
        while not waiter.done(job := self.get(job_id)):
            time.sleep(poll)
        return job


class AsyncReshardClient:
    """Asynchronous client with the same methods, as coroutines."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 30.0,
    ) -> None:
        base, headers = _config(url, token)
        self._http = httpx.AsyncClient(
            base_url=base, headers=headers, transport=transport, timeout=timeout
        )

    async def __aenter__(self) -> AsyncReshardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call[R]) -> R:
        try:
            resp = _check(await self._http.request(call.method, call.path, **call.options))
        except httpx.TransportError as e:
            raise TransportError(f"cannot reach {self._http.base_url}: {e}") from e
        return call.parse(resp.json())

    async def submit(
        self, spec: JobCreate | dict[str, Any], *, idempotency_key: str | None = None
    ) -> JobPublic:
        return await self._send(_Api.submit(spec, idempotency_key))

    async def get(self, job_id: str) -> JobPublic:
        return await self._send(_Api.get(job_id))

    async def list(
        self,
        *,
        state: str | None = None,
        limit: int = 50,
        offset: int = 0,
        owner: str | None = None,
    ) -> JobList:
        return await self._send(_Api.list(state, limit, offset, owner))

    async def audit(
        self, *, limit: int = 100, principal: str | None = None, before: int | None = None
    ) -> AuditList:
        return await self._send(_Api.audit(limit, principal, before))

    async def cancel(self, job_id: str) -> JobPublic:
        return await self._send(_Api.cancel(job_id))

    async def logs(self, job_id: str, *, offset: int = 0, tail: int | None = None) -> JobLogs:
        return await self._send(_Api.logs(job_id, offset, tail))

    async def checkpoint(self, uri: str) -> dict[str, Any]:
        return await self._send(_Api.checkpoint(uri))

    async def plan(self, spec: PlanCreate | dict[str, Any]) -> dict[str, Any]:
        """A dry run on the server (``reshard plan``): what each worker would do."""
        return await self._send(_Api.plan(spec))

    async def watch(self, spec: WatchCreate | dict[str, Any]) -> WatchPublic:
        """Convert each newly committed step of ``spec["root"]`` (see ``WatchCreate``)."""
        return await self._send(_Api.watch(spec))

    async def watches(self, *, all: bool = False) -> WatchList:
        return await self._send(_Api.watches(all))

    async def get_watch(self, watch_id: str) -> WatchPublic:
        return await self._send(_Api.get_watch(watch_id))

    async def unwatch(self, watch_id: str) -> WatchPublic:
        return await self._send(_Api.unwatch(watch_id))

    async def events(self, job_id: str) -> AsyncIterator[tuple[str, JobPublic]]:
        """Server-sent events until the job ends: ("progress" | "state", job)."""
        try:
            async with self._http.stream("GET", _Api.events_path(job_id), timeout=None) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _check(resp)
                parser = _SSE()
                async for line in resp.aiter_lines():
                    got = parser.feed(line)
                    if got is not None:
                        yield got[0], JobPublic.model_validate(got[1])
        except httpx.TransportError as e:
            raise TransportError(f"event stream broke: {e}") from e

    async def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_progress: Callable[[JobPublic], None] | None = None,
        poll: float = 0.5,
    ) -> JobPublic:
        """Wait until the job is succeeded, failed or cancelled; returns the final job."""
        import asyncio

        waiter = _Waiter(job_id, timeout, on_progress)
        while not waiter.done(job := await self.get(job_id)):
            await asyncio.sleep(poll)
        return job
