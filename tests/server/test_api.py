"""Auth, roots, validation and limits of the REST API, against a real server."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.server.conftest import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_token_required_everywhere_but_healthz(server):
    assert httpx.get(server.url + "/healthz").status_code == 200
    for method, path in [
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs/abc"),
        ("POST", "/v1/jobs/abc/cancel"),
        ("GET", "/v1/jobs/abc/logs"),
        ("GET", "/v1/jobs/abc/events"),
        ("GET", "/v1/checkpoints?uri=/x"),
        ("GET", "/metrics"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + TOKEN}):
            r = httpx.request(method, server.url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers.get("www-authenticate") == "Bearer"
    assert httpx.get(server.url + "/metrics", headers=AUTH).status_code == 200


def submit(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/jobs", json=body, headers=AUTH)


def test_paths_outside_roots_are_refused(server, tmp_path):
    root = tmp_path / "data"
    (root / "src").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "escape")
    good = str(root / "src")
    cases = [
        ({"source": f"{root}/../outside", "target": f"{root}/t"}, "source", "'..'"),
        ({"source": "/etc", "target": f"{root}/t"}, "source", "outside the allowed roots"),
        ({"source": good, "target": f"{root}/escape/t"}, "target", "outside the allowed roots"),
        ({"source": good, "target": "s3://other-bucket/t"}, "target", "outside the allowed roots"),
        ({"source": f"file://{root}/src::s3://b/x", "target": f"{root}/t"}, "source", "chained"),
        ({"source": "http://169.254.169.254/latest", "target": f"{root}/t"}, "source", "scheme"),
        ({"source": good, "target": str(root)}, "target", "outside the allowed roots"),
        ({"source": good + "?versionId=1", "target": f"{root}/t"}, "source", "query"),
    ]
    for body, field, words in cases:
        r = submit(server, body)
        assert r.status_code == 403, (body, r.text)
        detail = r.json()["detail"]
        assert detail.startswith(field) and words in detail, (body, detail)
    # A relative path is a malformed request, not a forbidden one: the server
    # cannot know the caller's working folder.
    r = submit(server, {"source": "relative/path", "target": f"{root}/t"})
    assert r.status_code == 422, r.text
    assert "absolute" in r.json()["detail"]
    r = httpx.get(server.url + "/v1/checkpoints", params={"uri": "/etc"}, headers=AUTH)
    assert r.status_code == 403


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"workers": 0}, "workers"),
        ({"workers": True}, "workers"),
        ({"workers": "2"}, "workers"),
        ({"checksum": "md5"}, "checksum"),
        ({"mesh": {"tp": 0}}, "mesh"),
        ({"mesh": {"t p": 2}}, "mesh"),
        ({"mesh": {"a": 2048, "b": 2048}}, "mesh"),
        ({"format": "zip"}, "format"),
        ({"dtype": "int3"}, "dtype"),
        ({"rules": {"*": "Q(0)"}}, "rules"),
        ({"max_memory": "lots"}, "max_memory"),
        ({"surprise": 1}, "surprise"),
        ({"source": None}, "source"),
    ],
)
def test_malformed_specs_get_422_naming_the_field(server, tmp_path, patch, field):
    body = {"source": str(tmp_path / "data" / "a"), "target": str(tmp_path / "data" / "b"), **patch}
    r = submit(server, body)
    assert r.status_code == 422, r.text
    locs = [".".join(str(x) for x in d["loc"]) for d in r.json()["detail"]]
    assert any(field in loc for loc in locs), locs


def test_limits_body_size_queue_and_unknown_jobs(make_server, tmp_path):
    server = make_server(max_queued="1", max_running="1")
    big = {"source": "/" + "x" * 100_000, "target": "/y"}
    assert submit(server, big).status_code == 413
    root = tmp_path / "data"
    ok = {"source": str(root / "missing-src"), "target": str(root / "t1")}
    codes = [submit(server, {**ok, "target": str(root / f"t{i}")}).status_code for i in range(6)]
    assert 429 in codes
    assert httpx.get(server.url + "/v1/jobs/nope", headers=AUTH).status_code == 404
    assert httpx.post(server.url + "/v1/jobs/nope/cancel", headers=AUTH).status_code == 404


def test_failed_job_reports_the_error(server, tmp_path):
    from reshard_client import ReshardClient

    with ReshardClient(server.url, TOKEN) as c:
        job = c.submit(
            {"source": str(tmp_path / "data" / "nothing"), "target": str(tmp_path / "data" / "t")}
        )
        final = c.wait(job.id, timeout=120)
    assert final.state.value == "failed"
    assert "NotACheckpointError" in final.error
