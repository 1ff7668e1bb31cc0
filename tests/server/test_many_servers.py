"""One active server per job database, a server that binds before it recovers, and jobs
an engine keeps waiting shown waiting (Slurm and the Kubernetes stand-in)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import TOKEN
from tests.server.test_jobs import slow_job
from tests.support.harness import free_port

pytestmark = pytest.mark.distributed


def second_server(env: dict[str, str], port: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reshard_server.main", "--port", str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
@pytest.mark.parametrize("same_port", [True, False])
def test_a_second_server_on_the_same_database_touches_nothing(make_server, tmp_path, same_port):
    first = make_server()
    job_id, dst = slow_job(first, tmp_path)
    r = second_server(first.env, first.port if same_port else free_port())
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"pid {first.proc.pid}" in lines[0] and f"127.0.0.1:{first.port}" in lines[0]
    assert "One server per database" in lines[0]
    with first.client() as c:
        done = c.wait(job_id, timeout=240)
    assert done.state.value == "succeeded", done.error
    assert done.attempts == 1


def test_a_port_clash_is_found_before_any_job_is_touched(make_server, tmp_path):
    first = make_server()
    env = {
        **first.env,
        "RESHARD_DB": str(tmp_path / "other.db"),
        "RESHARD_DATA_DIR": str(tmp_path / "other"),
    }
    r = second_server(env, first.port)
    assert r.returncode == 1 and "cannot listen on" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr
    assert httpx.get(first.url + "/healthz").status_code == 200


def test_the_server_answers_healthz_before_it_imports_torch(tmp_path):
    """A server starts in about a second because it does not import torch to answer (the
    jobs' workers do). Checked from the process's mappings, not with a clock: tests never
    assert times."""
    port = free_port()
    env = {
        "RESHARD_TOKEN": TOKEN,
        "RESHARD_ROOTS": str(tmp_path),
        "RESHARD_DB": str(tmp_path / "jobs.db"),
        "RESHARD_DATA_DIR": str(tmp_path / "d"),
    }
    import os

    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard_server.main", "--port", str(port)],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() - t0 < 60, "no answer"
            time.sleep(0.05)
        with open(f"/proc/{proc.pid}/maps") as f:
            mapped = f.read()
    finally:
        proc.terminate()
        proc.wait(30)
    assert "libtorch" not in mapped, "the server imported torch before it answered /healthz"


@pytest.mark.slurm
def test_slurm_keeps_a_job_pending_it_shows_queued_with_the_reason_then_fails(
    make_server, slurm, tmp_path
):
    """Two nodes asked of a one-node partition: Slurm keeps it PENDING for good."""
    from tests.server.conftest import make_tp4, tensors

    data = tmp_path / "data"
    make_tp4(str(data / "tp4"), str(tmp_path / "scratch"), tensors(1))
    server = make_server(
        env={"SLURM_CONF": str(slurm.conf)},
        launcher="slurm",
        slurm_log_dir=str(tmp_path / "slurm-logs"),
        pending_timeout_s="6",
    )
    with server.client() as c:
        job = c.submit(
            {
                "source": str(data / "tp4"),
                "target": str(data / "out"),
                "mesh": {"tp": 2},
                "nodes": 2,
                "workers_per_node": 1,
            }
        )
        deadline = time.monotonic() + 60
        while not (seen := c.get(job.id)).reason:
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)
        assert seen.state.value == "queued" and seen.reason.startswith("Slurm: "), seen
        slurm_id = seen.handle["slurm_job_id"]
        r = subprocess.run(
            [sys.executable, "-m", "reshard_client.cli", "status", job.id],
            env={**server.env, "RESHARD_URL": server.url},
            capture_output=True,
            text=True,
        )
        # the CLI shows Slurm's reason (which Slurm may refine meanwhile: PartitionConfig,
        # then PartitionNodeLimit)
        assert "waiting: Slurm: Partition" in r.stdout, r.stdout
        final = c.wait(job.id, timeout=120)
    assert final.state.value == "failed"  # (Slurm may refine its reason meanwhile)
    assert final.error.startswith("Slurm: Partition") and "RESHARD_PENDING_TIMEOUT_S" in final.error
    deadline = time.monotonic() + 30
    while slurm_id in slurm.run("squeue", "-h", "-o", "%i").stdout.split():
        assert time.monotonic() < deadline, "the Slurm job was left behind"
        time.sleep(0.2)


@pytest.mark.kubernetes
def test_kubernetes_unschedulable_pod_shows_queued_with_the_reason(make_server, k8s, tmp_path):
    from tests.server.conftest import make_tp4, tensors

    data = tmp_path / "data"
    make_tp4(str(data / "tp4"), str(tmp_path / "scratch"), tensors(1))
    server = make_server(
        env={"KUBECONFIG": str(k8s.kubeconfig)},
        launcher="kubernetes",
        k8s_image="reshard-svc:test",
        k8s_namespace="ml",
        k8s_gpus_per_node="8",
    )  # more GPUs than the stand-in's node has
    with server.client() as c:
        job = c.submit(
            {
                "source": str(data / "tp4"),
                "target": str(data / "out"),
                "mesh": {"tp": 2},
                "workers": 1,
            }
        )
        deadline = time.monotonic() + 60
        while not (seen := c.get(job.id)).reason:
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)
        assert seen.state.value == "queued"
        assert seen.reason.startswith("Kubernetes: Unschedulable: 0/1 nodes are available")
        c.cancel(job.id)
        final = c.wait(job.id, timeout=60)
    assert final.state.value == "cancelled"
    assert ("ml", f"reshard-{job.id}-1") not in k8s.jobs
