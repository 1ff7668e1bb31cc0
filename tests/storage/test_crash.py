"""A process killed with SIGKILL mid-save leaves nothing that passes for a checkpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import reshard_svc
from reshard_svc.errors import NotACheckpointError
from reshard_svc.format.collect import collect
from reshard_svc.format.index import INDEX_NAME, CheckpointIndex
from reshard_svc.storage import open_storage

CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    import reshard_svc
    from reshard_svc.storage import FsspecStorage, LocalStorage

    def die(self, *args, **kwargs):  # every data file is written; the commit never happens
        os.kill(os.getpid(), signal.SIGKILL)

    LocalStorage.commit = die
    FsspecStorage.commit = die
    reshard_svc.save({"w": torch.full((64, 64), float(sys.argv[2]))}, sys.argv[1], overwrite=True)
    """
)


def run_child(uri: str, value: float) -> int:
    return subprocess.run([sys.executable, "-c", CHILD, uri, str(value)], timeout=120).returncode


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_sigkill_before_commit(tmp_path, request, backend):
    root = str(tmp_path) if backend == "local" else request.getfixturevalue("s3")
    uri = f"{root}/ck"
    assert run_child(uri, 1.0) == -9
    with pytest.raises(NotACheckpointError):
        reshard_svc.inspect(uri)
    assert not reshard_svc.verify(uri).ok

    # With a committed checkpoint in place, a killed overwrite leaves the old one intact.
    reshard_svc.save({"w": torch.full((64, 64), 2.0)}, uri, overwrite=True)
    assert run_child(uri, 3.0) == -9
    out = {"w": torch.zeros(64, 64)}
    reshard_svc.load(out, uri)
    assert torch.equal(out["w"], torch.full((64, 64), 2.0))
    assert reshard_svc.verify(uri).ok
    # And the next save succeeds, and collects what the killed ones left (their leases
    # name a process that is gone).
    reshard_svc.save({"w": torch.full((64, 64), 4.0)}, uri, overwrite=True)
    reshard_svc.load(out, uri)
    assert out["w"][0, 0].item() == 4.0
    assert leftovers(root, uri) == []


def leftovers(root: str, uri: str) -> list[str]:
    """Staging data, old folders and leases of the target, or data files no index names."""
    if root.startswith("s3://"):
        storage = open_storage(uri)
        named = set(CheckpointIndex.loads(storage.read(INDEX_NAME)).files)
        return [n for n in storage.listdir() if n != INDEX_NAME and n not in named]
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith(".ck."))


TORN_INDEX = textwrap.dedent(
    """
    import builtins, os, signal, sys, torch
    import reshard_svc

    real_open = builtins.open

    class Torn:  # writes half of what it is given, then the process is killed
        def __init__(self, f):
            self.f = f
        def write(self, data):
            self.f.write(bytes(data)[: len(data) // 2])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        def __getattr__(self, name):
            return getattr(self.f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def tearing_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "reshard.index.json" in os.path.basename(str(path)) and "w" in mode:
            return Torn(f)
        return f

    builtins.open = tearing_open
    reshard_svc.save({"w": torch.full((64, 64), float(sys.argv[2]))}, sys.argv[1], overwrite=True)
    """
)


def test_sigkill_while_the_index_is_written_never_commits_a_torn_index(tmp_path):
    """The index is the commit's decision: killed half way through writing it, the save
    is not decided (the index is written beside and renamed), so neither a resume nor
    ``gc`` ever rolls a torn index forward; the old checkpoint stays whole."""
    uri = str(tmp_path / "ck")
    reshard_svc.save({"w": torch.full((64, 64), 2.0)}, uri)
    r = subprocess.run([sys.executable, "-c", TORN_INDEX, uri, "3.0"], timeout=120)
    assert r.returncode == -9
    assert leftovers(str(tmp_path), uri)  # the killed run's staging folder and lease
    report = collect(uri)  # the killed run was the owner of record
    assert report.rolled_forward == [], report
    assert reshard_svc.verify(uri).ok
    out = {"w": torch.zeros(64, 64)}
    reshard_svc.load(out, uri)
    assert torch.equal(out["w"], torch.full((64, 64), 2.0))
    assert leftovers(str(tmp_path), uri) == []
