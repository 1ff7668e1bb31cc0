"""Overwrite policy, leases and garbage collection, on every backend and on real crashes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import reshard_svc
from reshard_svc.errors import TargetExistsError
from reshard_svc.format import collect as gc
from reshard_svc.format.index import INDEX_NAME
from reshard_svc.storage import open_storage
from tests.support.cli import reshard as run_cli
from tests.support.processes import dead_pid


def sd(value: float) -> dict:
    return {"w": torch.full((64, 32), value), "b": torch.arange(7.0) + value}


def read(uri: str) -> float:
    out = {"w": torch.zeros(64, 32), "b": torch.zeros(7)}
    reshard_svc.load(out, uri)
    assert torch.equal(out["b"], torch.arange(7.0) + out["w"][0, 0])
    return float(out["w"][0, 0])


@contextlib.contextmanager
def zombie_pid() -> Iterator[int]:
    """A child that has exited and is not reaped yet (a zombie), reaped on exit."""
    p = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while True:
            with open(f"/proc/{p.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    break
            if time.monotonic() > deadline:
                raise AssertionError("the child never exited")
            time.sleep(0.01)
        yield p.pid
    finally:
        p.wait()


def test_overwrite_needs_consent_and_keeps_foreign_files(root):
    uri = f"{root}/ck"
    reshard_svc.save(sd(1.0), uri)
    storage = open_storage(uri)
    storage.write("mine.txt", b"keep me")
    with pytest.raises(TargetExistsError, match="overwrite=True"):
        reshard_svc.save(sd(2.0), uri)
    reshard_svc.convert(uri, uri + "x")
    with pytest.raises(TargetExistsError):
        reshard_svc.convert(uri + "x", uri)
    assert read(uri) == 1.0
    reshard_svc.save(sd(2.0), uri, overwrite=True)
    assert read(uri) == 2.0
    assert storage.read("mine.txt") == b"keep me"
    # Exactly the new checkpoint's files, the index and the foreign file are left.
    index = json.loads(storage.read(INDEX_NAME))
    assert set(storage.listdir()) == {*index["files"], INDEX_NAME, "mine.txt"}


def test_cli_convert_overwrite_repro(tmp_path):
    """The issue's repro: a foreign file in the target survives an overwrite."""
    reshard_svc.save(sd(3.0), str(tmp_path / "ck"))
    reshard_svc.save(sd(4.0), str(tmp_path / "tgt"))
    (tmp_path / "tgt" / "mine.txt").write_text("x")
    r = run_cli("convert", str(tmp_path / "ck"), str(tmp_path / "tgt"), "--mesh", "tp=1")
    assert r.returncode == 2 and "--overwrite" in r.stderr and "Traceback" not in r.stderr
    assert read(str(tmp_path / "tgt")) == 4.0
    r = run_cli(
        "convert", str(tmp_path / "ck"), str(tmp_path / "tgt"), "--mesh", "tp=1", "--overwrite"
    )
    assert r.returncode == 0, r.stderr
    assert read(str(tmp_path / "tgt")) == 3.0
    assert (tmp_path / "tgt" / "mine.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "tgt"]


def fake_run(storage, token: str, *, pid: int, expires_in: float, owner: str = "") -> None:
    """What a run that died after writing its data (and before committing) leaves: its
    lease and a data file under the names reshard gives them."""
    from reshard_svc.storage.leases import LeaseRecord

    now = time.time()
    rec = LeaseRecord(
        token=token,
        kind="save",
        owner=owner,
        host=os.uname().nodename,
        pid=pid,
        started=now - 1,
        ttl=expires_in + 1,
        renewed=now - 1,
    )
    storage.create_lease(rec.dumps(), token)
    if expires_in < 0 and not storage.uri.startswith(("memory", "s3")):
        os.utime(storage.lease_path(), (now - 10, now - 10))  # the mtime says when it lived
    staging = storage.staging(token)
    staging.write(f"shard-00000-000{staging.file_suffix}.safetensors", b"x" * 100)


@pytest.mark.parametrize(
    ("pid", "expires_in", "owner", "collected"),
    [
        (None, 60, "", False),  # live: this process holds it
        ("dead", 60, "", True),  # its process is gone
        ("zombie", 60, "", True),  # its process exited and nobody reaped it (PID 1 in a container)
        (None, -1, "", True),  # expired
        (None, 60, "reshard-job-7", True),  # the server says job 7 is over
    ],
)
def test_collect_only_stale_runs(root, pid, expires_in, owner, collected):
    uri = f"{root}/ck"
    reshard_svc.save(sd(5.0), uri)
    storage = open_storage(uri)
    before = set(storage.listdir())
    token = "ab" * 16
    with contextlib.ExitStack() as stack:
        holder = {
            None: os.getpid,
            "dead": dead_pid,
            "zombie": lambda: stack.enter_context(zombie_pid()),
        }[pid]()
        fake_run(storage, token, pid=holder, expires_in=expires_in, owner=owner)
        dry = gc.collect(uri, owner=owner or None, dry_run=True)
        assert bool(dry) == collected
        report = gc.collect(uri, owner=owner or None)
    assert bool(report) == collected
    assert (report.live == [token]) != collected
    if collected:
        assert set(storage.listdir()) == before
        assert storage.read_lease() is None
        if not root.startswith(("memory", "s3")):
            assert [p for p in os.listdir(root) if p.startswith(".ck.")] == []
    assert read(uri) == 5.0


CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    import reshard_svc.storage.local as local

    real = os.rename
    def rename(a, b):
        # Die at the chosen step of the local commit's folder swap.
        if sys.argv[2] == "swap" and ".staging-" in a and ".old-" not in b:
            os.kill(os.getpid(), signal.SIGKILL)
        real(a, b)
        if sys.argv[2] == "moved" and ".old-" in b:
            os.kill(os.getpid(), signal.SIGKILL)
    local.os.rename = rename
    import reshard_svc
    reshard_svc.save({"w": torch.full((64, 32), 9.0), "b": torch.arange(7.0) + 9.0},
                     sys.argv[1], overwrite=True)
    """
)


@pytest.mark.parametrize("step", ["moved", "swap"])
def test_interrupted_local_commit_is_finished(tmp_path, step):
    """Killed after the target moved aside (the new index is in staging): gc rolls the
    commit forward, and the foreign file moves with it."""
    uri = str(tmp_path / "ck")
    reshard_svc.save(sd(1.0), uri)
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    r = subprocess.run([sys.executable, "-c", CHILD, uri, step], timeout=120, check=False)
    assert r.returncode == -9
    assert not (tmp_path / "ck").exists()  # mid-swap: neither folder in place
    out = run_cli("gc", uri, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert len(report["rolled_forward"]) == 1
    assert read(uri) == 9.0
    assert (tmp_path / "ck" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_half_swapped_commit_without_decided_index_rolls_back(tmp_path):
    uri = str(tmp_path / "ck")
    reshard_svc.save(sd(2.0), uri)
    storage = open_storage(uri)
    token = "cd" * 16
    os.rename(uri, storage._sibling("old", token))  # crashed right after moving it aside
    out = run_cli("gc", uri)
    assert out.returncode == 0 and "restore" in out.stdout
    assert read(uri) == 2.0
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["ck"]


def test_gc_of_a_clean_folder_says_so(tmp_path):
    reshard_svc.save(sd(1.0), str(tmp_path / "ck"))
    out = run_cli("gc", str(tmp_path / "ck"))
    assert out.returncode == 0 and "nothing to collect" in out.stdout


def test_a_lease_renamed_aside_by_a_killed_release_or_takeover_is_collected(tmp_path):
    """Releasing or taking over a lease renames it aside first (``<lease>.drop-<pid>-…``,
    ``<lease>.taken-<pid>-…``): killed before removing it, the aside is the dead process's
    and gc removes it; a live process's aside (mid-operation) stays."""
    uri = str(tmp_path / "ck")
    reshard_svc.save(sd(1.0), uri)
    dead = dead_pid()
    lease = open_storage(uri).lease_path()
    left = [
        Path(f"{lease}.drop-{dead}-{'a' * 32}"),
        Path(f"{lease}.taken-{dead}-{'b' * 32}"),
    ]
    live = Path(f"{lease}.drop-{os.getpid()}-{'c' * 32}")
    for p in (*left, live):
        p.write_bytes(b"{}")
    out = run_cli("gc", uri, "--json")
    assert out.returncode == 0, out.stderr
    removed = json.loads(out.stdout)["removed"]
    assert all(str(p) in removed and not p.exists() for p in left)
    assert live.exists()
    assert read(uri) == 1.0


def test_a_lease_record_left_mid_renewal_by_a_dead_process_is_collected(tmp_path):
    """A renewal writes ``<lease>.<pid>.tmp`` and renames it over the lease: killed in
    between, the temporary file is the dead process's; gc removes it, a live one's stays."""
    uri = str(tmp_path / "ck")
    reshard_svc.save(sd(1.0), uri)
    dead = dead_pid()
    lease = open_storage(uri).lease_path()
    left = Path(f"{lease}.{dead}.tmp")
    live = Path(f"{lease}.{os.getpid()}.tmp")
    left.write_bytes(b"{}")
    live.write_bytes(b"{}")
    out = run_cli("gc", uri, "--json")
    assert out.returncode == 0, out.stderr
    assert str(left) in json.loads(out.stdout)["removed"]
    assert not left.exists() and live.exists()
    assert read(uri) == 1.0


class _Killed(BaseException):
    """Stands for SIGKILL (not an Exception: nothing on the way catches it)."""


def test_a_retention_killed_after_uncommitting_a_step_is_finished_on_every_backend(
    root, monkeypatch
):
    """Retention uncommits a step (its index goes), then removes the files the index
    listed. Killed in between, on any store, the next retention finishes it from the
    retirement record, and the checkpoint's other steps are untouched."""
    from reshard_svc import CheckpointManager
    from reshard_svc.storage.fsspec_store import FsspecStorage

    run = f"{root}/run"
    with CheckpointManager(run, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, sd(float(step)))
    real_remove = FsspecStorage.remove
    calls = []

    def remove(self, name):
        if name.endswith(".safetensors"):  # the index has gone, the data files not yet
            raise _Killed
        calls.append(name)
        real_remove(self, name)

    with CheckpointManager(run, keep_last=2, async_save=False) as mgr:
        monkeypatch.setattr(FsspecStorage, "remove", remove)
        with pytest.raises(_Killed):
            mgr.save(3, sd(3.0))
        monkeypatch.setattr(FsspecStorage, "remove", real_remove)
        assert INDEX_NAME in calls and mgr.steps() == [2, 3]
        assert open_storage(f"{run}/step-0000000001").listdir()  # files left behind
        mgr.save(4, sd(4.0))
        assert mgr.steps() == [3, 4]
    assert sorted(open_storage(run).listdir()) == ["step-0000000003", "step-0000000004"]
    assert read(f"{run}/step-0000000004") == 4.0
