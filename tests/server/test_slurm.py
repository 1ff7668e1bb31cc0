"""RESHARD_LAUNCHER=slurm against a real Slurm (slurmctld + slurmd + munged on 127.0.0.1).

A 2-node job runs as 2 Slurm tasks on the one test node, each a torchrun agent
(``--nnodes 2``, c10d rendezvous): ``RESHARD_SLURM_EXTRA_ARGS`` packs both tasks on one
node, the way an operator would pass any sbatch option.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import reshard_svc
from tests.server.conftest import assert_holds, make_tp4, tensors

pytestmark = [pytest.mark.distributed, pytest.mark.slurm]

TWO_TASKS_ONE_NODE = "--nodes=1 --ntasks-per-node=2"


def slurm_server(make_server, slurm, tmp_path, **settings: str):
    return make_server(
        env={"SLURM_CONF": str(slurm.conf)},
        launcher="slurm",
        slurm_extra_args=TWO_TASKS_ONE_NODE,
        slurm_log_dir=str(tmp_path / "slurm-logs"),
        **settings,
    )


def squeue_ids(slurm) -> set[str]:
    return set(slurm.run("squeue", "-h", "-o", "%i").stdout.split())


def test_two_node_conversion_equals_local(make_server, slurm, tmp_path):
    sd = tensors(3, rows=96)
    data = tmp_path / "data"
    src = str(data / "tp4")
    make_tp4(src, str(tmp_path / "scratch"), sd)
    spec = {"source": src, "mesh": {"dp": 2, "tp": 2},
            "rules": {"w": "S(0),S(1)", "o": "R,S(1)", "b": "R,R"}}  # fmt: skip
    server = slurm_server(make_server, slurm, tmp_path)
    with server.client() as c:
        job = c.submit({**spec, "target": str(data / "slurm"), "nodes": 2,
                        "workers_per_node": 1})  # fmt: skip
        seen = []
        done = c.wait(job.id, timeout=240, on_progress=seen.append)
        logs = c.logs(job.id).text
        assert done.state.value == "succeeded", (done.error, logs)
        assert done.spec.nodes == 2 and done.spec.workers == 2
        # progress came over the callback, the final numbers too
        assert done.progress.bytes_done == done.progress.bytes_total > 0
        assert "2 torchrun nodes" in logs, logs
    # the same conversion on the local launcher (2 workers on one node), bitwise
    server.stop()
    local = make_server()
    with local.client() as c:
        job = c.submit({**spec, "target": str(data / "local"), "workers": 2})
        assert c.wait(job.id, timeout=240).state.value == "succeeded"
    assert_holds(str(data / "slurm"), sd)
    a = reshard_svc.inspect(str(data / "slurm"))
    b = reshard_svc.inspect(str(data / "local"))
    assert a.to_json()["tensors"] == b.to_json()["tensors"]
    x, y = ({k: torch.zeros_like(v) for k, v in sd.items()} for _ in range(2))
    reshard_svc.load(x, str(data / "slurm"))
    reshard_svc.load(y, str(data / "local"))
    for name in sd:
        assert torch.equal(x[name], y[name]) and torch.equal(x[name], sd[name]), name


def slow_slurm_job(server, tmp_path, name: str) -> tuple[str, str]:
    from tests.server.test_jobs import slow_job

    return slow_job(server, tmp_path, name, nodes=2)


def test_cancel_runs_scancel_and_never_commits(make_server, slurm, tmp_path):
    server = slurm_server(make_server, slurm, tmp_path)
    job_id, dst = slow_slurm_job(server, tmp_path, "cancel")
    with server.client() as c:
        running = c.get(job_id)
        assert running.engine == "slurm"
        slurm_id = running.handle["slurm_job_id"]
        assert slurm_id in squeue_ids(slurm)
        c.cancel(job_id)
        final = c.wait(job_id, timeout=90)
        assert final.state.value == "cancelled", final.error
    state = slurm.run("scontrol", "show", "job", slurm_id).stdout
    assert "JobState=CANCELLED" in state, state
    time.sleep(2)  # nothing commits late
    assert not os.path.exists(os.path.join(dst, "reshard.index.json"))


def test_server_restart_reattaches_running_job(make_server, slurm, tmp_path):
    server = slurm_server(make_server, slurm, tmp_path)
    job_id, dst = slow_slurm_job(server, tmp_path, "restart")
    server.kill9()
    time.sleep(1)
    assert squeue_ids(slurm), "the Slurm job must outlive the server"
    server.start()  # same database: re-attach, do not launch again
    with server.client() as c:
        final = c.wait(job_id, timeout=240)
        assert final.state.value == "succeeded", (final.error, c.logs(job_id).text)
        assert final.attempts == 1
    assert reshard_svc.verify(dst).ok


def readme_block(name: str) -> str:
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "README.md").read_text()
    m = re.search(rf"<!-- {name}:start -->\s*```\w+\n(.*?)```\s*<!-- {name}:end -->", text, re.S)
    assert m, f"README lost its {name} block"
    return m.group(1)


def test_readme_batch_script_runs_the_worker_without_a_server(slurm, tmp_path):
    """The README's sbatch script, as written; only the one-node packing is overridden."""
    import sys

    sd = tensors(5)
    src, dst = tmp_path / "tp4", tmp_path / "tp4-again"
    make_tp4(str(src), str(tmp_path / "scratch"), sd)
    script = tmp_path / "reshard.sbatch"
    script.write_text(readme_block("slurm-direct"))
    env = {**slurm.env, "SRC": str(src), "DST": str(dst), "GPUS_PER_NODE": "1",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}  # fmt: skip
    import subprocess

    r = subprocess.run(
        ["sbatch", "--wait", "--parsable", *TWO_TASKS_ONE_NODE.split(), str(script)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = next(tmp_path.glob("reshard-*.log"), None)
    assert r.returncode == 0, (r.stderr, log and log.read_text()[-3000:])
    assert_holds(str(dst), sd)
    assert reshard_svc.inspect(str(dst)).to_json()["tensors"]["w"]["layout"]["mesh"]["shape"] == [4]


def test_readme_multi_node_submit(make_server, slurm, tmp_path):
    """The README's ``reshard submit --nodes 2 ... --wait`` line on the real Slurm: the
    bucket becomes a local root and 8 workers per node become 1 (two cores here)."""
    import shlex
    import subprocess
    import sys

    from tests.server.conftest import TOKEN

    sd = tensors(3, rows=64)
    data = tmp_path / "data"
    make_tp4(str(data / "llama-tp8"), str(tmp_path / "scratch"), sd)
    line = readme_block("slurm-submit").replace("\\\n", " ")
    line = line.replace("s3://checkpoints", str(data)).replace("--workers-per-node 8",
                                                               "--workers-per-node 1")  # fmt: skip
    argv = shlex.split(line)
    assert argv[0] == "reshard" and "--nodes" in argv, argv
    server = slurm_server(make_server, slurm, tmp_path)
    env = {**os.environ, "RESHARD_URL": server.url, "RESHARD_TOKEN": TOKEN}
    r = subprocess.run(
        [sys.executable, "-m", "reshard_client.cli", *argv[1:]],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert_holds(str(data / "llama-tp4"), sd)
    tp = reshard_svc.inspect(str(data / "llama-tp4")).tensors
    assert {t.layout.mesh.shape for t in tp.values()} == {(4,)}
