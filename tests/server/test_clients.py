"""The async client and the SSE stream against a real server; a MockTransport for errors."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from reshard_client import AsyncReshardClient, Invalid, NotFound, ReshardClient, Unauthorized
from tests.server.conftest import TOKEN, assert_holds, make_tp4, tensors

pytestmark = pytest.mark.distributed


def test_async_client_and_event_stream(server, tmp_path):
    sd = tensors(3)
    src = str(tmp_path / "data" / "src")
    make_tp4(src, str(tmp_path / "scratch"), sd)
    dst = str(tmp_path / "data" / "dst")

    async def scenario():
        async with AsyncReshardClient(server.url, TOKEN) as c:
            job = await c.submit({"source": src, "target": dst, "mesh": {"tp": 2}, "workers": 2})
            events = [(e, j.state.value) async for e, j in c.events(job.id)]
            final = await c.wait(job.id, timeout=120)
            listed = await c.list(state="succeeded")
            logs = await c.logs(job.id, tail=3)
            with pytest.raises(NotFound):
                await c.get("nope")
            return events, final, listed, logs

    events, final, listed, logs = asyncio.run(scenario())
    assert events[-1] == ("state", "succeeded")
    assert all(e == "progress" for e, _ in events[:-1]) and events[0][0] == "progress"
    assert final.state.value == "succeeded" and listed.total == 1
    assert logs.size > 0
    assert_holds(dst, sd)


def test_typed_errors_from_a_mock_transport():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer t":
            return httpx.Response(401, json={"detail": "missing or wrong bearer token"})
        return httpx.Response(
            422, json={"detail": [{"loc": ["body", "workers"], "msg": "must be >= 1"}]}
        )

    with ReshardClient("http://x", "wrong", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(Unauthorized):
            c.get("abc")
    with ReshardClient("http://x", "t", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(Invalid, match="workers: must be >= 1"):
            c.submit({"source": "/a", "target": "/b"})
