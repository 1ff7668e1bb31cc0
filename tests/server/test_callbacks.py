"""Progress reaches the server over HTTP, authenticated by a token minted per job."""

from __future__ import annotations

import httpx
import pytest

from reshard_server.launchers import job_pids
from tests.server.conftest import TOKEN
from tests.server.test_jobs import slow_job

pytestmark = pytest.mark.distributed


def worker_env(job_id: str) -> dict[str, str]:
    """The environment a worker of the job really got (read from /proc)."""
    for pid in job_pids(job_id):
        try:
            raw = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        env = dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)
        if "RESHARD_CALLBACK_TOKEN" in env:
            return env
    raise AssertionError(f"no worker of {job_id} found")


@pytest.mark.slow
def test_callback_tokens_are_per_job(make_server, tmp_path):
    server = make_server(max_running="2")
    a, _ = slow_job(server, tmp_path, "a")
    env_a = worker_env(a)
    b, _ = slow_job(server, tmp_path, "b")
    env_b = worker_env(b)
    assert env_a["RESHARD_CALLBACK_URL"] == f"{server.url}/v1/jobs/{a}/events"
    assert env_a["RESHARD_CALLBACK_TOKEN"] != env_b["RESHARD_CALLBACK_TOKEN"]
    assert "RESHARD_TOKEN" not in env_a  # workers never see the API token
    event = {
        "event": "progress",
        "bytes_done": 1,
        "bytes_total": 2,
        "tensors_done": 0,
        "tensors_total": 3,
    }

    def post(job: str, token: str | None, body: object = event) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = httpx.post(f"{server.url}/v1/jobs/{job}/events", json=body, headers=headers)
        return r.status_code

    assert post(b, env_a["RESHARD_CALLBACK_TOKEN"]) == 403  # another job's token
    assert post(b, "not-a-token") == 401
    assert post(b, TOKEN) == 401  # the admin token is not a job token
    assert post(b, None) == 401
    assert post(a, env_a["RESHARD_CALLBACK_TOKEN"], {"event": "done"}) == 422
    assert post(a, env_a["RESHARD_CALLBACK_TOKEN"], {**event, "bytes_done": -1}) == 422
    with server.client() as c:
        for job in (a, b):
            c.cancel(job)
        assert c.wait(a, timeout=60).state.terminal
        assert c.wait(b, timeout=60).state.value == "cancelled"


@pytest.mark.slow
def test_progress_arrives_without_a_shared_filesystem(server, tmp_path):
    """No progress file exists anywhere: the server learns everything from callbacks."""
    job_id, _ = slow_job(server, tmp_path, "p")
    with server.client() as c:
        job = c.get(job_id)
        assert 0 < job.progress.bytes_done <= job.progress.bytes_total
        final = c.wait(job_id, timeout=240)
    assert final.state.value == "succeeded"
    assert final.progress.bytes_done == final.progress.bytes_total
    assert not list((tmp_path / "server-data").rglob("*.jsonl"))
