"""RESHARD_LAUNCHER=ray against a real Ray cluster (``ray start``: a head with the job API
and one more worker node on this host, 2 CPUs each).

A 2-node job is a ``STRICT_SPREAD`` placement group of one bundle per node and one torchrun
agent per bundle, submitted through Ray's job API; the server hears Ray's own words while
Ray cannot place a job, stops Ray jobs it cancels, and re-attaches after a restart.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import reshard_svc
from reshard_server.launchers import job_pids
from tests.server.conftest import assert_holds, assert_reattaches, make_tp4, tensors

pytestmark = [pytest.mark.distributed, pytest.mark.ray]


def ray_server(make_server, ray_cluster, **settings: str):
    return make_server(launcher="ray", ray_address=ray_cluster.address, **settings)


def test_two_node_conversion_on_ray_is_bitwise(make_server, ray_cluster, tmp_path):
    sd = tensors(4, rows=96)
    data = tmp_path / "data"
    src = str(data / "tp4")
    make_tp4(src, str(tmp_path / "scratch"), sd)
    server = ray_server(make_server, ray_cluster)
    with server.client() as c:
        job = c.submit(
            {
                "source": src,
                "target": str(data / "ray"),
                "mesh": {"dp": 2, "tp": 2},
                "rules": {"w": "S(0),S(1)", "o": "R,S(1)", "b": "R,R"},
                "nodes": 2,
                "workers_per_node": 1,
            }
        )
        done = c.wait(job.id, timeout=240)
        logs = c.logs(job.id).text
        assert done.state.value == "succeeded", (done.error, logs)
        assert done.engine == "ray" and done.handle["ray_job"] in ray_cluster.jobs()
        assert ray_cluster.jobs()[done.handle["ray_job"]] == "SUCCEEDED"
        assert "2 torchrun nodes" in logs, logs
        assert done.progress.bytes_done == done.progress.bytes_total > 0  # over the callback
    assert_holds(str(data / "ray"), sd)
    x = {k: torch.zeros_like(v) for k, v in sd.items()}
    reshard_svc.load(x, str(data / "ray"))
    assert all(torch.equal(x[k], sd[k]) for k in sd)


def test_a_job_larger_than_the_cluster_waits_with_rays_reason_then_fails(
    make_server, ray_cluster, tmp_path
):
    sd = tensors(5)
    src = str(tmp_path / "data" / "tp4")
    make_tp4(src, str(tmp_path / "scratch"), sd)
    server = ray_server(make_server, ray_cluster, pending_timeout_s="6")
    with server.client() as c:
        job = c.submit(
            {
                "source": src,
                "target": str(tmp_path / "data" / "big"),
                "mesh": {"tp": 3},
                "rules": {"b": "R"},
                "nodes": 3,
                "workers_per_node": 1,
            }
        )
        deadline = time.monotonic() + 120
        while True:
            j = c.get(job.id)
            if j.state.value == "queued" and j.reason and "cluster has 2 nodes" in j.reason:
                break
            assert j.state.value in ("queued", "running") and time.monotonic() < deadline, j
            time.sleep(0.2)
        assert "Ray: placement group" in j.reason, j.reason
        final = c.wait(job.id, timeout=120)
        assert final.state.value == "failed", final
        sid = final.handle["ray_job"]
    deadline = time.monotonic() + 60  # Ray stops the job and frees its placement group
    while (
        ray_cluster.jobs().get(sid) not in ("STOPPED", "FAILED") or ray_cluster.placement_groups()
    ):
        assert time.monotonic() < deadline, (ray_cluster.jobs(), ray_cluster.placement_groups())
        time.sleep(0.5)
    assert not os.path.exists(tmp_path / "data" / "big" / "reshard.index.json")


def test_cancel_stops_the_ray_job_and_commits_nothing(make_server, ray_cluster, tmp_path):
    from tests.server.test_jobs import slow_job

    server = ray_server(make_server, ray_cluster)
    job_id, dst = slow_job(server, tmp_path, "cancel", nodes=2)
    with server.client() as c:
        sid = c.get(job_id).handle["ray_job"]
        assert ray_cluster.jobs()[sid] == "RUNNING"
        c.cancel(job_id)
        final = c.wait(job_id, timeout=90)
        assert final.state.value == "cancelled", final.error
    deadline = time.monotonic() + 60
    while ray_cluster.jobs()[sid] != "STOPPED" or job_pids(job_id):
        assert time.monotonic() < deadline, (ray_cluster.jobs()[sid], job_pids(job_id))
        time.sleep(0.5)
    time.sleep(2)  # nothing commits late
    assert not os.path.exists(os.path.join(dst, "reshard.index.json"))


def test_server_restart_reattaches_to_the_running_ray_job(make_server, ray_cluster, tmp_path):
    from tests.server.test_jobs import slow_job

    server = ray_server(make_server, ray_cluster)
    job_id, dst = slow_job(server, tmp_path, "restart", nodes=2)
    assert_reattaches(server, job_id, dst, lambda: "RUNNING" in ray_cluster.jobs().values(), "Ray")


def test_readme_ray_job_submit_runs_the_worker_without_a_server(ray_cluster, tmp_path):
    """The README's ``ray job submit`` command, as written, on the two-node cluster."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.server.test_slurm import readme_block

    sd = tensors(6)
    src, dst = tmp_path / "tp4", tmp_path / "tp2"
    make_tp4(str(src), str(tmp_path / "scratch"), sd)
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster.address,
        "SRC": str(src),
        "DST": str(dst),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    r = subprocess.run(
        ["bash", "-c", readme_block("ray-direct")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "2 torchrun nodes" in r.stdout
    assert_holds(str(dst), sd)
