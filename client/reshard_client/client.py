"""``ReshardClient`` and ``AsyncReshardClient``: the control plane over HTTP (httpx).

Both take an injectable ``transport`` (``httpx.MockTransport``, ``httpx.ASGITransport``)
for tests, and default to ``RESHARD_URL`` / ``RESHARD_TOKEN`` from the environment.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx

from reshard_client.errors import TransportError, error_for
from reshard_server.schemas import JobCreate, JobList, JobLogs, JobPublic

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

    def _req(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return _check(self._http.request(method, path, **kw))
        except httpx.TransportError as e:
            raise TransportError(f"cannot reach {self._http.base_url}: {e}") from e

    def submit(
        self, spec: JobCreate | dict[str, Any], *, idempotency_key: str | None = None
    ) -> JobPublic:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return JobPublic.model_validate(
            self._req("POST", "/v1/jobs", json=_spec(spec), headers=headers).json()
        )

    def get(self, job_id: str) -> JobPublic:
        return JobPublic.model_validate(self._req("GET", f"/v1/jobs/{job_id}").json())

    def list(self, *, state: str | None = None, limit: int = 50, offset: int = 0) -> JobList:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if state:
            params["state"] = state
        return JobList.model_validate(self._req("GET", "/v1/jobs", params=params).json())

    def cancel(self, job_id: str) -> JobPublic:
        return JobPublic.model_validate(self._req("POST", f"/v1/jobs/{job_id}/cancel").json())

    def logs(self, job_id: str, *, offset: int = 0, tail: int | None = None) -> JobLogs:
        params: dict[str, Any] = {"offset": offset}
        if tail:
            params["tail"] = tail
        return JobLogs.model_validate(
            self._req("GET", f"/v1/jobs/{job_id}/logs", params=params).json()
        )

    def events(self, job_id: str) -> Iterator[tuple[str, JobPublic]]:
        """Server-sent events until the job ends: ("progress" | "state", job)."""
        try:
            with self._http.stream("GET", f"/v1/jobs/{job_id}/events", timeout=None) as resp:
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

    def checkpoint(self, uri: str) -> dict[str, Any]:
        return self._req("GET", "/v1/checkpoints", params={"uri": uri}).json()  # type: ignore[no-any-return]

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_progress: Callable[[JobPublic], None] | None = None,
        poll: float = 0.5,
    ) -> JobPublic:
        """Block until the job is succeeded, failed or cancelled; returns the final job."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if on_progress is not None:
                on_progress(job)
            if job.state.value in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.state.value} after {timeout} s")
            time.sleep(poll)


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

    async def _req(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return _check(await self._http.request(method, path, **kw))
        except httpx.TransportError as e:
            raise TransportError(f"cannot reach {self._http.base_url}: {e}") from e

    async def submit(
        self, spec: JobCreate | dict[str, Any], *, idempotency_key: str | None = None
    ) -> JobPublic:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        resp = await self._req("POST", "/v1/jobs", json=_spec(spec), headers=headers)
        return JobPublic.model_validate(resp.json())

    async def get(self, job_id: str) -> JobPublic:
        return JobPublic.model_validate((await self._req("GET", f"/v1/jobs/{job_id}")).json())

    async def list(self, *, state: str | None = None, limit: int = 50, offset: int = 0) -> JobList:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if state:
            params["state"] = state
        return JobList.model_validate((await self._req("GET", "/v1/jobs", params=params)).json())

    async def cancel(self, job_id: str) -> JobPublic:
        return JobPublic.model_validate(
            (await self._req("POST", f"/v1/jobs/{job_id}/cancel")).json()
        )

    async def logs(self, job_id: str, *, offset: int = 0, tail: int | None = None) -> JobLogs:
        params: dict[str, Any] = {"offset": offset}
        if tail:
            params["tail"] = tail
        resp = await self._req("GET", f"/v1/jobs/{job_id}/logs", params=params)
        return JobLogs.model_validate(resp.json())

    async def events(self, job_id: str) -> AsyncIterator[tuple[str, JobPublic]]:
        try:
            async with self._http.stream("GET", f"/v1/jobs/{job_id}/events", timeout=None) as resp:
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
        self, job_id: str, *, timeout: float | None = None, poll: float = 0.5
    ) -> JobPublic:
        import asyncio

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = await self.get(job_id)
            if job.state.value in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.state.value} after {timeout} s")
            await asyncio.sleep(poll)
