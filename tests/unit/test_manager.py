"""CheckpointManager in one process: steps, retention, resume, failures, signals, memory."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reshard_svc
from reshard_svc import CheckpointManager, SaveFailedError, TargetBusyError
from reshard_svc.format.steps import step_name
from reshard_svc.plan.retention import retained
from reshard_svc.sessions.steps import list_steps
from tests.support.processes import dead_pid


@given(
    steps=st.lists(st.integers(0, 500), max_size=40, unique=True),
    keep_last=st.one_of(st.none(), st.integers(1, 10)),
    keep_every=st.one_of(st.none(), st.integers(1, 50)),
)
def test_retention_keeps_what_the_policy_names_and_never_the_newest(steps, keep_last, keep_every):
    keep = retained(steps, keep_last, keep_every)
    assert keep <= set(steps)
    if steps:
        assert max(steps) in keep
    if keep_last is None and keep_every is None:
        assert keep == set(steps)
        return
    newest = sorted(steps)[-keep_last:] if keep_last else []
    milestones = {s for s in steps if keep_every and s % keep_every == 0}
    assert keep == set(newest) | milestones | ({max(steps)} if steps else set())


def state(value: float) -> dict:
    return {"w": torch.full((64, 32), value), "b": torch.full((32,), value), "step": int(value)}


def test_steps_retention_and_resume(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root, interval=2, keep_last=2, keep_every=6) as mgr:
        saved = [s for s in range(1, 15) if mgr.save(s, state(float(s)))]
        mgr.wait()
        assert saved == [2, 4, 6, 8, 10, 12, 14]
        assert mgr.last_wait_s >= 0.0
        assert mgr.steps() == [6, 12, 14] and mgr.latest() == 14
    assert sorted(os.listdir(root)) == [step_name(s) for s in (6, 12, 14)]
    with CheckpointManager(root) as mgr:
        got = state(0.0)
        assert mgr.load(got) == 14
        assert torch.equal(got["w"], torch.full((64, 32), 14.0)) and got["step"] == 14
        older = state(0.0)
        assert mgr.load(older, step=6) == 6 and older["step"] == 6
        index = reshard_svc.inspect(f"{root}/{step_name(14)}")
        assert index.extras["checkpoint_manager.step"] == 14


def test_a_fresh_root_loads_nothing(tmp_path):
    with CheckpointManager(str(tmp_path / "new")) as mgr:
        assert mgr.load(state(0.0)) is None and mgr.steps() == []


def test_half_written_and_unreadable_steps_are_skipped_with_a_warning(tmp_path, caplog):
    root = tmp_path / "run"
    with CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(3, state(3.0))
    (root / step_name(5)).mkdir()  # a save that never committed
    (root / step_name(5) / "shard-00000.safetensors").write_bytes(b"partial")
    (root / step_name(7)).mkdir()
    (root / step_name(7) / "reshard.index.json").write_text("{not json")
    with CheckpointManager(str(root)) as mgr, caplog.at_level(logging.WARNING):
        assert mgr.steps() == [3, 7]  # an index exists; 7's does not parse
        got = state(0.0)
        assert mgr.load(got) == 3 and got["step"] == 3
    assert "skipped" in caplog.text and "5" in caplog.text and "7" in caplog.text


KILLED_AT_SWAP = """
import os, signal, sys, torch
import reshard_svc.storage.local as local
from reshard_svc import CheckpointManager

real = os.rename
def rename(a, b):  # die once step 2's commit is decided (its index in staging), unmoved
    if ".step-0000000002.staging-" in a:
        os.kill(os.getpid(), signal.SIGKILL)
    real(a, b)
local.os.rename = rename
with CheckpointManager(sys.argv[1], async_save=False) as mgr:
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((64, 32), float(step)), "step": step})
"""


def test_a_commit_decided_by_a_killed_job_is_finished_before_the_resume_picks(tmp_path, caplog):
    """Killed between writing step 2's index and moving its folder into place: the next
    manager finishes that commit when it takes the root, so it resumes from step 2 (and
    saving step 3 meets no leftover)."""
    import subprocess
    import sys

    root = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-c", KILLED_AT_SWAP, root], timeout=120, check=False)
    assert r.returncode == -signal.SIGKILL
    assert [n for n in os.listdir(root) if not n.startswith(".")] == [step_name(1)]
    with caplog.at_level(logging.WARNING), CheckpointManager(root, keep_last=1) as mgr:
        assert mgr.steps() == [1, 2]
        got = {"w": torch.zeros(64, 32), "step": 0}
        assert mgr.load(got) == 2 and got["step"] == 2
        assert torch.equal(got["w"], torch.full((64, 32), 2.0))
        mgr.save(3, {"w": torch.full((64, 32), 3.0), "step": 3})
        mgr.wait()
        assert mgr.steps() == [3]
    assert "interrupted commit of step 2" in caplog.text
    assert sorted(os.listdir(root)) == [step_name(3)]  # no staging, old or lease file left


def test_a_second_job_on_the_same_root_is_refused_naming_the_holder(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root):
        with pytest.raises(TargetBusyError, match=f"pid {os.getpid()}|{os.getpid()}"):
            CheckpointManager(root)
    CheckpointManager(root).close()  # released on close


def test_a_background_failure_is_raised_at_the_next_save_naming_the_step(tmp_path, monkeypatch):
    """The disk fills up while step 2 is written in the background."""
    from reshard_svc.runtime import async_save

    real = async_save.write_files

    def full_disk(prep, rank, staging=None):
        if prep.uri.endswith(step_name(2)):
            raise OSError(28, "No space left on device")
        return real(prep, rank, staging)

    monkeypatch.setattr(async_save, "write_files", full_disk)
    root = tmp_path / "run"
    with CheckpointManager(str(root)) as mgr:
        assert mgr.save(1, state(1.0))
        assert mgr.save(2, state(2.0))  # the snapshot returns; the write fails later
        with pytest.raises(SaveFailedError, match="step 2 .*No space left") as e:
            mgr.save(3, state(3.0))
        assert e.value.step == 2
        assert mgr.steps() == [1]
        assert mgr.save(3, state(3.0))  # training goes on; the next save works
        mgr.wait()
        assert mgr.steps() == [1, 3]


def test_rank_local_keys_fall_back_with_a_warning(tmp_path, caplog):
    root = str(tmp_path / "run")
    with CheckpointManager(root, rank_local=["rng"], async_save=False) as mgr:
        mgr.save(1, {**state(1.0), "rng": torch.get_rng_state()})
    rng = torch.get_rng_state()
    torch.rand(3)
    with CheckpointManager(root, rank_local=["rng"]) as mgr:
        got = {**state(0.0), "rng": torch.zeros_like(rng)}
        assert mgr.load(got) == 1
        assert torch.equal(got["rng"], rng)
    # a step saved without it (another world size): the caller's value, one warning
    root2 = str(tmp_path / "run2")
    with CheckpointManager(root2, async_save=False) as mgr:
        mgr.save(1, state(1.0))
    with CheckpointManager(root2, rank_local=["rng"]) as mgr, caplog.at_level(logging.WARNING):
        mine = torch.ones(4)
        got = {**state(0.0), "rng": mine}
        assert mgr.load(got) == 1 and got["rng"] is mine
    assert "keeping the value passed in" in caplog.text


def test_a_signal_makes_the_next_save_final_and_synchronous(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root, interval=100, save_on_signals=[signal.SIGUSR1]) as mgr:
        assert not mgr.save(1, state(1.0))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mgr.save(2, state(2.0)) and mgr.should_stop
        assert mgr.steps() == [2]  # committed before save returned
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow
def test_fifty_saves_do_not_grow_memory(tmp_path):
    root = str(tmp_path / "run")
    big = {"w": torch.randn(2048, 1024), "b": torch.randn(1024)}  # 8 MiB
    with CheckpointManager(root, keep_last=1) as mgr:
        for step in range(1, 51):
            big["w"].add_(1.0)
            mgr.save(step, big)
            if step == 2:
                mgr.wait()
                after_second = _rss_mb()
        mgr.wait()
        assert mgr.steps() == [50]
        assert _rss_mb() <= after_second * 1.05, (after_second, _rss_mb())


def test_readme_steps_commands(tmp_path):
    """The README's ``reshard steps`` lines, on a root the manager wrote (and a partial step)."""
    import json
    import shlex

    from tests.support.cli import reshard

    root, fast = tmp_path / "ckpt", tmp_path / "shm"
    tier = reshard_svc.FastTier(str(fast), every=50)
    with CheckpointManager(str(root), async_save=False, fast=tier) as mgr:
        for step in (100, 150, 200, 250):
            mgr.save(step, state(1.0))
    (root / step_name(300)).mkdir()
    (root / step_name(300) / "shard-00000-000.safetensors").write_bytes(b"x" * 10)
    from tests.support.docs import block

    lines = [ln.split("  #")[0].strip() for ln in block("steps", "bash").splitlines() if ln.strip()]
    assert len(lines) == 3
    outs = []
    for line in lines:
        where = {"/tmp/ckpt": str(root), "/dev/shm/reshard/run-7": str(fast)}
        argv = [where.get(a, a) for a in shlex.split(line)[1:]]
        r = reshard(*argv)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        outs.append(r.stdout)
    assert "partial" in outs[0] and "committed" in outs[0]
    rows = {s["step"]: s for s in json.loads(outs[1])["steps"]}
    assert {s: r["policy"] for s, r in rows.items()} == {
        100: "keep",
        150: "delete",
        200: "keep",
        250: "keep",
        300: None,
    }
    assert rows[300]["committed"] is False and rows[300]["bytes"] == 10
    assert {r["tier"] for r in rows.values()} == {"persistent"}
    assert "fast" in outs[2]  # the fast tier's newest two steps, beside the root's
    assert outs[2].count("fast") >= 2 and "250" in outs[2]
    assert sorted(os.listdir(root)) == [step_name(s) for s in (100, 150, 200, 250, 300)]
    fast_rows = [r for r in list_steps(str(root), fast=str(fast)) if r.tier == "fast"]
    assert len(fast_rows) == 2 and all(r.committed and r.policy is None for r in fast_rows)
    for r in fast_rows:  # every file of the step: its record, its part and their index
        on_disk = sum(f.stat().st_size for f in (fast / r.name).rglob("*") if f.is_file())
        assert r.bytes == on_disk > 0, (r, on_disk)


def _dead_save_lease(path) -> None:
    """A step's lease as a save writes it, held by a process that is gone."""
    import json
    import socket

    record = {
        "host": socket.gethostname(),
        "kind": "save",
        "owner": "",
        "pid": dead_pid(),
        "pid_start": 1,
        "renewed": 0.0,
        "replaces": [],
        "started": 0.0,
        "token": "0" * 32,
        "ttl": 120.0,
    }
    path.write_text(json.dumps(record))


def test_retention_collects_the_lease_of_a_save_killed_before_its_folder(tmp_path):
    """A save holds its step's lease before it makes the folder: killed in between, it
    leaves only ``.step-N.lease.json``, which the next retention collects (a dead pid)."""
    root = tmp_path / "run"
    root.mkdir()
    _dead_save_lease(root / f".{step_name(5)}.lease.json")
    other = root / "notes.lease.json"  # not ours: never touched
    other.write_text("{}")
    with CheckpointManager(str(root), keep_last=2, async_save=False) as mgr:
        mgr.save(10, {"w": torch.zeros(3)})
    assert sorted(os.listdir(root)) == ["notes.lease.json", step_name(10)]


def test_retention_collects_the_lease_of_a_save_killed_after_its_commit(tmp_path):
    """Killed after its commit and before releasing its lease, a save leaves a committed
    step with a stale lease beside it: the next retention removes the lease, and the
    step, which its policy keeps, stays whole."""
    root = tmp_path / "run"
    with CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(7, {"w": torch.full((3,), 7.0)})
    _dead_save_lease(root / f".{step_name(7)}.lease.json")
    with CheckpointManager(str(root), keep_last=2, async_save=False) as mgr:
        mgr.save(8, {"w": torch.full((3,), 8.0)})
        assert mgr.steps() == [7, 8]
    assert sorted(os.listdir(root)) == [step_name(7), step_name(8)]
    assert reshard_svc.verify(str(root / step_name(7))).ok


def test_retention_collects_a_lease_a_killed_release_renamed_aside(tmp_path):
    """Releasing a step's lease renames it aside, then removes it: killed in between, only
    ``.step-N.lease.json.drop-<pid>-<uuid>`` is left (no lease, no folder); the next
    retention collects it (a dead pid), and leaves files that are not ours alone."""
    root = tmp_path / "run"
    root.mkdir()
    aside = root / f".{step_name(23)}.lease.json.drop-{dead_pid()}-{'0' * 32}"
    aside.write_text("{}")
    other = root / f".{step_name(24)}.lease.json.notes"  # not a lease operation's: kept
    other.write_text("{}")
    with CheckpointManager(str(root), keep_last=2, async_save=False) as mgr:
        mgr.save(30, {"w": torch.zeros(3)})
    assert sorted(os.listdir(root)) == [other.name, step_name(30)]


class _Killed(BaseException):
    """Stands for SIGKILL inside a retirement (not an Exception: nothing catches it)."""


@pytest.mark.parametrize("kill_after", [0, 1, 2])
def test_a_retirement_killed_midway_is_finished_by_the_next(tmp_path, monkeypatch, kill_after):
    """Retention removes a step's index, then the files it lists. Killed after any of its
    removals, the next save's retention finishes it from the retirement record, and a file
    that is not the checkpoint's stays with its folder."""
    from reshard_svc.storage.local import LocalStorage

    root = tmp_path / "run"
    value = {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(64)}
    with CheckpointManager(str(root), async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, value)
    (root / step_name(2) / "notes.txt").write_text("mine")
    removals = {"n": 0}
    real_remove = LocalStorage.remove

    def remove(self, name):
        if removals["n"] == kill_after:
            raise _Killed
        removals["n"] += 1
        real_remove(self, name)

    with CheckpointManager(str(root), keep_last=2, async_save=False) as mgr:
        monkeypatch.setattr(LocalStorage, "remove", remove)
        with pytest.raises(_Killed):
            mgr.save(4, value)  # its retention retires step 1, and is killed
        monkeypatch.setattr(LocalStorage, "remove", real_remove)
        assert mgr.steps() == ([1, 2, 3, 4] if kill_after == 0 else [2, 3, 4])
        assert os.listdir(root / step_name(1))
        first = list_steps(str(root))[0]  # what `reshard steps` shows
        want = ("keep", True) if kill_after == 0 else ("delete", False)  # next one deletes it
        assert (first.step, first.policy, first.committed) == (1, *want)
        mgr.save(5, value)  # retires 2 and 3 (and 1, if still committed), finishes 1
        assert mgr.steps() == [4, 5]
    assert sorted(os.listdir(root)) == [step_name(s) for s in (2, 4, 5)]
    assert os.listdir(root / step_name(2)) == ["notes.txt"]  # not ours: it stays


def test_the_roots_lease_debris_of_a_dead_job_is_collected_at_construction(tmp_path):
    """A job killed while renewing or taking over the root's lease leaves
    ``.run.lease.json.<pid>.tmp`` or ``.run.lease.json.taken-<pid>-<token>`` beside the
    root: the next manager on that root removes a dead process's, never a live one's."""
    root = tmp_path / "run"
    root.mkdir()
    dead = dead_pid()
    stale = [f".run.lease.json.{dead}.tmp", f".run.lease.json.taken-{dead}-{'1' * 32}"]
    alive = [f".run.lease.json.taken-{os.getpid()}-{'2' * 32}", ".run.lease.json.notes"]
    for name in stale + alive:
        (tmp_path / name).write_text("{}")
    with CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(3)})
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".run")) == sorted(alive)


def test_if_busy_defer_never_waits_and_commits_every_step_it_says_it_saved(tmp_path, monkeypatch):
    """Saves slower than steps: a due save finding the previous in flight is deferred to
    the next call (which saves); every save said saved commits; force and a stop signal
    still save."""
    import time

    import reshard_svc.runtime.async_save as async_module

    real = async_module.write_files

    def slow(*args, **kwargs):  # the forked writer runs this too: a slow store
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(async_module, "write_files", slow)
    outcomes = {}
    with CheckpointManager(
        str(tmp_path / "root"), interval=2, if_busy="defer", save_on_signals=[signal.SIGUSR2]
    ) as mgr:
        for step in range(1, 25):
            force = step == 13
            if step == 21:
                os.kill(os.getpid(), signal.SIGUSR2)
            outcomes[step] = mgr.save(step, state(float(step)), force=force)
            if mgr.should_stop:
                break
            time.sleep(0.05)
        mgr.wait()
        committed = mgr.steps()
    saved = [s for s, o in outcomes.items() if o]
    assert committed == saved, (committed, outcomes)
    deferred = [s for s, o in outcomes.items() if not o and o.reason.startswith("deferred")]
    assert deferred, outcomes  # saves took 0.3 s, steps 0.05 s: some were put off
    assert all(outcomes[s + 1] or outcomes[s + 1].reason.startswith("deferred") for s in deferred)
    assert outcomes[13] and outcomes[21] and max(outcomes) == 21  # force, then the signal
    got = state(-1.0)
    with CheckpointManager(str(tmp_path / "root")) as mgr:
        assert mgr.load(got) == 21
    assert torch.equal(got["w"], state(21.0)["w"])


def test_if_busy_is_checked(tmp_path):
    with pytest.raises(reshard_svc.UsageError, match="if_busy"):
        CheckpointManager(str(tmp_path / "root"), if_busy="skip")
