"""Jobs through a real server: S3 (moto) end to end with the client and the CLI, cancel,
kill -9 and restart, idempotency."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time

import pytest
import torch

import reshard_svc
from reshard_client import Conflict
from reshard_server.launchers import job_pids
from reshard_svc.errors import NotACheckpointError
from tests.server.conftest import assert_holds, cli, make_tp4, tensors

pytestmark = pytest.mark.distributed


@pytest.mark.s3
def test_tp4_to_tp2_on_s3_with_client_and_cli(make_server, s3, tmp_path):
    sd = tensors(1)
    make_tp4(f"{s3}/tp4", str(tmp_path / "scratch"), sd)
    server = make_server(roots=[s3])
    with server.client() as c:
        job = c.submit(
            {"source": f"{s3}/tp4", "target": f"{s3}/tp2", "mesh": {"tp": 2}, "workers": 2}
        )
        assert job.state.value == "queued"
        seen = []
        done = c.wait(job.id, timeout=240, on_progress=seen.append)
        assert done.state.value == "succeeded", (done.error, c.logs(job.id, tail=40).text)
        assert done.progress.bytes_done == done.progress.bytes_total > 0
        assert done.progress.tensors_done == 3
        assert "reshard_svc.worker" in c.logs(job.id).text
        info = c.checkpoint(f"{s3}/tp2")
        assert info["tensors"]["w"]["layout"]["mesh"]["shape"] == [2]
    assert_holds(f"{s3}/tp2", sd)

    r = cli(
        server,
        "submit",
        f"{s3}/tp4",
        f"{s3}/tp2-cli",
        "--mesh",
        "tp=2",
        "--workers",
        "2",
        "--wait",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)
    assert job["state"] == "succeeded"
    assert_holds(f"{s3}/tp2-cli", sd)
    r = cli(server, "jobs", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["total"] == 2
    r = cli(server, "status", job["id"])
    assert r.returncode == 0 and "succeeded" in r.stdout
    r = cli(server, "logs", job["id"], "--tail", "5")
    assert r.returncode == 0


def slow_job(server, tmp_path, name: str = "slow", nodes: int = 1) -> tuple[str, str]:
    """Submit a conversion that runs for several seconds (tiny memory budget)."""
    data = tmp_path / "data"
    sd = {"w": torch.randn(8192, 2048)}  # 64 MiB: several seconds at a 64 KiB budget
    src = str(data / f"{name}-src")
    make_tp4(
        src, str(tmp_path / f"{name}-scratch"), {**sd, "o": torch.zeros(2, 4), "b": torch.zeros(1)}
    )
    dst = str(data / f"{name}-dst")
    with server.client() as c:
        job = c.submit(
            {
                "source": src,
                "target": dst,
                "mesh": {"tp": 2},
                "workers": 2,
                "nodes": nodes,
                "rules": {"w": "S(1)"},
                "max_memory": "64KiB",
                "strategy": "exchange",
            }
        )
        deadline = time.monotonic() + 120
        while True:
            j = c.get(job.id)
            if j.state.value == "running" and j.progress.bytes_done > 0:
                return job.id, dst
            assert j.state.value in ("queued", "running") and time.monotonic() < deadline, j
            time.sleep(0.05)


def test_cancel_mid_job(server, tmp_path):
    job_id, dst = slow_job(server, tmp_path)
    with server.client() as c:
        c.cancel(job_id)
        final = c.wait(job_id, timeout=60)
        assert final.state.value == "cancelled"
        assert final.progress.bytes_done < final.progress.bytes_total
    with pytest.raises(NotACheckpointError):
        reshard_svc.inspect(dst)
    assert job_pids(job_id) == []
    assert leftovers(dst) == []  # the server collected the job's staging data


def leftovers(dst: str) -> list[str]:
    """Staging / old folders and leases beside ``dst``."""
    parent, name = os.path.split(dst)
    return [p for p in os.listdir(parent) if p.startswith(f".{name}.")]


@pytest.mark.slow
def test_kill9_server_mid_job_then_restart(make_server, tmp_path):
    server = make_server()
    job_id, dst = slow_job(server, tmp_path)
    server.kill9()
    deadline = time.monotonic() + 30
    while job_pids(job_id):  # workers die with the server: no orphans
        assert time.monotonic() < deadline, "workers outlived the server"
        time.sleep(0.1)
    assert not os.path.exists(os.path.join(dst, "reshard.index.json"))
    server.start()  # same database
    with server.client() as c:
        final = c.wait(job_id, timeout=240)
        assert final.state.value == "succeeded", final.error
        assert final.attempts == 2
    assert reshard_svc.verify(dst).ok
    assert leftovers(dst) == []  # the first attempt's staging went with its dead lease


def test_idempotency_key_sequential_and_concurrent(server, tmp_path):
    src = str(tmp_path / "data" / "src")
    make_tp4(src, str(tmp_path / "scratch"), tensors(2))
    spec = {"source": src, "target": str(tmp_path / "data" / "dst"), "mesh": {"tp": 2}}
    with server.client() as c:
        a = c.submit(spec, idempotency_key="k1")
        b = c.submit(spec, idempotency_key="k1")
        assert a.id == b.id
        with pytest.raises(Conflict):
            c.submit({**spec, "mesh": {"tp": 1}}, idempotency_key="k1")

        def submit(_):
            with server.client() as cc:
                return cc.submit({**spec, "target": spec["target"] + "2"}, idempotency_key="k2").id

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            ids = set(pool.map(submit, range(8)))
        assert len(ids) == 1
        assert c.list().total == 2
        assert c.wait(a.id, timeout=120).state.value == "succeeded"
