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
from tests.server.conftest import assert_holds, assert_reattaches, make_tp4, tensors

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
    spec = {
        "source": src,
        "mesh": {"dp": 2, "tp": 2},
        "rules": {"w": "S(0),S(1)", "o": "R,S(1)", "b": "R,R"},
    }
    server = slurm_server(make_server, slurm, tmp_path)
    with server.client() as c:
        job = c.submit({**spec, "target": str(data / "slurm"), "nodes": 2, "workers_per_node": 1})
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
    assert_reattaches(server, job_id, dst, lambda: bool(squeue_ids(slurm)), "Slurm")


def readme_block(name: str) -> str:
    from tests.support.docs import block

    return block(name)


def test_readme_batch_script_runs_the_worker_without_a_server(slurm, tmp_path):
    """The README's sbatch script, as written; only the one-node packing is overridden."""
    import sys

    sd = tensors(5)
    src, dst = tmp_path / "tp4", tmp_path / "tp4-again"
    make_tp4(str(src), str(tmp_path / "scratch"), sd)
    script = tmp_path / "reshard.sbatch"
    script.write_text(readme_block("slurm-direct"))
    env = {
        **slurm.env,
        "SRC": str(src),
        "DST": str(dst),
        "GPUS_PER_NODE": "1",
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
    }
    import subprocess

    r = subprocess.run(
        ["sbatch", "--wait", "--parsable", *TWO_TASKS_ONE_NODE.split(), str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    line = line.replace("s3://checkpoints", str(data)).replace(
        "--workers-per-node 8", "--workers-per-node 1"
    )
    argv = shlex.split(line)
    assert argv[0] == "reshard" and "--nodes" in argv, argv
    server = slurm_server(make_server, slurm, tmp_path)
    env = {**os.environ, "RESHARD_URL": server.url, "RESHARD_TOKEN": TOKEN}
    r = subprocess.run(
        [sys.executable, "-m", "reshard_client.cli", *argv[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert_holds(str(data / "llama-tp4"), sd)
    tp = reshard_svc.inspect(str(data / "llama-tp4")).tensors
    assert {t.layout.mesh.shape for t in tp.values()} == {(4,)}


PREEMPTIBLE = """\
import os, sys
sys.path.insert(0, {repo!r})
os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                  LOCAL_RANK=os.environ["SLURM_LOCALID"], OMP_NUM_THREADS="1")
import torch.distributed as dist
from tests.support.manager_jobs import preemptible_loop
dist.init_process_group("gloo")
out = preemptible_loop(sys.argv[1], int(sys.argv[2]), sys.argv[3])
print("result", out["start"], out["last"], out["stopped"], flush=True)
dist.barrier()
os._exit(0)  # torch 2.13's gloo may abort in teardown; the verdict is in
"""


def test_scancel_signal_term_ends_in_a_final_checkpoint_and_exit_0(slurm, tmp_path):
    """A training job on Slurm (``srun`` tasks, the CheckpointManager with SIGTERM):
    ``scancel --signal=TERM`` → every task saves the same final step, the job completes
    with exit code 0, and the rerun resumes from that step."""
    import subprocess
    import sys
    from pathlib import Path

    from reshard_svc.format.steps import step_name
    from tests.support.harness import free_port

    repo = str(Path(__file__).resolve().parents[2])
    (tmp_path / "loop.py").write_text(PREEMPTIBLE.format(repo=repo))
    root, ready = tmp_path / "run", tmp_path / "ready"
    script = tmp_path / "train.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --output=job-%j.log\n"
        f"export MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()}\n"
        f'srun {sys.executable} loop.py {root} "$STEPS" {ready}\n'
    )
    env = {**slurm.env, "STEPS": "100000"}
    r = subprocess.run(
        ["sbatch", "--parsable", *TWO_TASKS_ONE_NODE.split(), str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    deadline = time.time() + 240
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert ready.exists(), (tmp_path / f"job-{job}.log").read_text()[-3000:]
    slurm.run("scancel", "--signal=TERM", job)
    while job in squeue_ids(slurm) and time.time() < deadline:
        time.sleep(0.5)
    log = (tmp_path / f"job-{job}.log").read_text()
    results = [line.split()[1:] for line in log.splitlines() if line.startswith("result ")]
    assert len(results) == 2 and results[0] == results[1], log[-3000:]
    start, last, stopped = results[0]
    assert stopped == "True", log[-3000:]
    info = slurm.run("scontrol", "show", "job", job).stdout
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info
    assert (root / step_name(int(last)) / "reshard.index.json").exists()
    # the rerun resumes from it
    env["STEPS"] = "2"
    r = subprocess.run(
        ["sbatch", "--wait", "--parsable", *TWO_TASKS_ONE_NODE.split(), str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    again = (tmp_path / f"job-{r.stdout.strip().split(';')[0]}.log").read_text()
    starts = {line.split()[1] for line in again.splitlines() if line.startswith("result ")}
    assert starts == {str(int(last) + 1)}, again[-3000:]
