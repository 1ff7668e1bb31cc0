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
            seen = []
            final = await c.wait(job.id, timeout=120, on_progress=seen.append)
            assert seen and seen[-1].state.value == "succeeded"
            info = await c.checkpoint(dst)
            assert info["tensors"]
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


def test_both_clients_offer_the_same_calls():
    """One core drives both; their public methods and signatures stay the same."""
    import inspect

    def surface(cls):
        names = {n for n in dir(cls) if not n.startswith("_")} - {"close", "aclose"}
        return {n: inspect.signature(getattr(cls, n)).parameters.keys() for n in names}

    sync, asyn = surface(ReshardClient), surface(AsyncReshardClient)
    assert sync.keys() == asyn.keys()
    for name in sync:
        assert list(sync[name]) == list(asyn[name]), name


def test_mock_transport_sees_the_same_requests_from_both():
    seen: list[tuple[str, str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.url.query.decode()))
        if request.url.path.endswith("/logs"):
            return httpx.Response(
                200, json={"id": "j1", "offset": 0, "next_offset": 0, "size": 0, "text": ""}
            )
        return httpx.Response(200, json={"items": [], "total": 0, "limit": 5, "offset": 0})

    with ReshardClient("http://x", "t", transport=httpx.MockTransport(handler)) as c:
        c.list(state="failed", limit=5)
        c.logs("j1", offset=3, tail=7)
    sync_seen, seen[:] = list(seen), []

    async def go():
        async with AsyncReshardClient("http://x", "t", transport=httpx.MockTransport(handler)) as c:
            await c.list(state="failed", limit=5)
            await c.logs("j1", offset=3, tail=7)

    asyncio.run(go())
    assert seen == sync_seen and len(seen) == 2
