"""The server-side frictions a new user meets: relative paths, and Ctrl-C while waiting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import TOKEN
from tests.server.test_jobs import slow_job

pytestmark = pytest.mark.distributed


def cli_env(server) -> dict[str, str]:
    return {**os.environ, "RESHARD_URL": server.url, "RESHARD_TOKEN": TOKEN}


def test_relative_paths_are_resolved_by_the_cli_and_named_by_the_api(server, tmp_path):
    from tests.server.conftest import make_tp4, tensors

    data = tmp_path / "data"
    make_tp4(str(data / "tp4"), str(tmp_path / "scratch"), tensors(2))
    r = httpx.post(
        server.url + "/v1/jobs",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={"source": "data/tp4", "target": str(data / "out")},
    )
    assert r.status_code == 422 and "source 'data/tp4' is a relative path" in r.text
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "reshard_client.cli",
            "submit",
            "data/tp4",
            "data/out",
            "--mesh",
            "tp=2",
            "--wait",
            "--json",
        ],
        cwd=tmp_path,
        env=cli_env(server),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert '"target": "' + str(data / "out") + '"' in r.stdout
    assert (data / "out" / "reshard.index.json").exists()


def test_ctrl_c_while_waiting_says_the_job_keeps_running(server, tmp_path):
    job_id, _ = slow_job(server, tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard_client.cli", "wait", job_id],
        env=cli_env(server),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    first = proc.stderr.readline()  # its first progress line: it follows the job now
    assert first, "reshard wait printed nothing"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = first + err
    assert proc.returncode == 130, err
    assert f"job {job_id} keeps running; `reshard cancel {job_id}` stops it" in err
    assert "Traceback" not in err
    with server.client() as c:
        assert c.get(job_id).state.value in ("running", "succeeded")
        c.cancel(job_id)
