"""CheckpointManager in real multi-rank jobs: FSDP × TP with retention, resumed at other
world sizes and layouts; a job stopped by SIGTERM saves its last step and resumes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from reshard_svc.format.steps import step_name
from reshard_svc.plan.retention import retained
from tests.support import manager_jobs as jobs
from tests.support.harness import JOBS, job_processes, run, wait_dead

pytestmark = [pytest.mark.distributed]


@pytest.mark.slow
def test_fsdp_tp_loop_keeps_the_policys_steps_and_resumes_anywhere(tmp_path):
    root, ref = str(tmp_path / "run"), str(tmp_path / "ref.safetensors")
    policy = {"interval": 2, "keep_last": 2, "keep_every": 6}
    got = run(jobs.train_and_checkpoint, 4, root, ref, 14, 2, 2, policy)
    want = sorted(retained(range(2, 15, 2), 2, 6))
    assert want == [6, 12, 14] and all(v == want for v in got.values())
    assert sorted(os.listdir(root)) == [step_name(s) for s in want]  # nothing else left
    # resumed on 2 ranks at TP=2, and on 3 ranks with FSDP: the state of step 14, bitwise
    assert run(jobs.resume_and_compare, 2, root, ref, 2, 1) == {r: (14, []) for r in range(2)}
    assert run(jobs.resume_and_compare, 3, root, ref, 1, 3) == {r: (14, []) for r in range(3)}


def _loop(root: str, ready: str, out: multiprocessing.Queue) -> None:
    out.put(run(jobs.preemptible_loop, 2, root, 10_000, ready))


@pytest.mark.slow
def test_sigterm_saves_the_last_step_and_the_rerun_resumes_from_it(tmp_path):
    """As torchrun forwards SIGTERM (and Slurm's ``scancel --signal=TERM`` signals the
    tasks): every worker gets it, they agree at the next step, save it, and exit 0."""
    root, ready = str(tmp_path / "run"), str(tmp_path / "ready")
    ctx = JOBS
    out = ctx.Queue()
    launcher = ctx.Process(target=_loop, args=(root, ready, out))
    launcher.start()
    deadline = time.time() + 240
    while not os.path.exists(ready) and time.time() < deadline:
        time.sleep(0.2)
    assert os.path.exists(ready), "the job never reached its first checkpoint"
    # every process of the job, as Slurm signals a step's tasks: the workers and any
    # background writer they forked (which leaves the signal to its trainer)
    procs = job_processes(launcher.pid)
    assert len(procs) >= 2
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)
    result = out.get(timeout=240)
    launcher.join(timeout=60)
    assert launcher.exitcode == 0
    assert all(r["stopped"] for r in result.values()), result
    last = {r["last"] for r in result.values()}
    assert len(last) == 1, result  # every rank stopped at the same step
    (final,) = last
    assert final % 5 != 0 or final > 5  # the final save was the signal's, at any step
    assert os.path.isdir(os.path.join(root, step_name(final)))
    assert os.path.exists(os.path.join(root, step_name(final), "reshard.index.json"))
    # the rerun resumes from it
    again = run(jobs.preemptible_loop, 2, root, 2, str(tmp_path / "ready2"))
    assert {r["start"] for r in again.values()} == {final + 1}


def _forever(root: str, ready: str) -> None:
    run(jobs.save_forever, 2, root, ready)


@pytest.mark.slow
def test_kill_9_at_random_points_always_resumes_from_a_whole_committed_step(tmp_path):
    """The whole job killed (-9) at random moments of its save loop (snapshot, write,
    commit, retention): each resume loads the newest committed step, bitwise; no folder is
    ever committed half-written; the resume's retention collects all the dead job left."""
    import random

    import psutil

    import reshard_svc

    root = str(tmp_path / "run")
    rng = random.Random(7)
    ctx = JOBS
    last = 0
    for point in range(10):
        ready = str(tmp_path / f"ready{point}")
        job = ctx.Process(target=_forever, args=(root, ready))
        job.start()
        deadline = time.time() + 120
        while not os.path.exists(ready) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        family = psutil.Process(job.pid).children(recursive=True)
        for p in [psutil.Process(job.pid), *family]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        job.join(timeout=30)
        wait_dead(family)
        step, ok = jobs.resume_and_check_here(root)  # another world: this one process
        assert ok, (point, step)
        assert step is not None and step >= last, (point, step, last)
        last = step + 1
        for name in os.listdir(root):  # whatever says committed is whole
            if os.path.exists(os.path.join(root, name, "reshard.index.json")):
                assert reshard_svc.verify(os.path.join(root, name)).ok, name
        # the resume's save ran retention: the newest 2 committed steps, no leftovers
        names = sorted(os.listdir(root))
        assert len(names) == 2 and all(
            os.path.exists(os.path.join(root, n, "reshard.index.json")) for n in names
        ), (point, names)
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".run") and "lease" in n]
