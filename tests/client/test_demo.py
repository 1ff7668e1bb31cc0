"""``make demo`` (the main job) runs end to end: server, CLI submit, verify, bitwise check."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.distributed
def test_demo_runs_end_to_end_and_keeps_its_checkpoints(tmp_path):
    folder = tmp_path / "demo"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for _ in range(2):  # a second run clears only what the first one made
        r = subprocess.run(
            [sys.executable, "-m", "reshard_client.demo", "--dir", str(folder)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "bitwise equal to the originals: yes" in r.stdout
        assert "succeeded" in r.stdout
        assert str(folder) in " ".join(r.stdout.split())  # it says where they are
    names = {p.name for p in folder.iterdir()}
    assert {"ckpt-tp8", "ckpt-tp2", "notes.txt"} <= names
    assert (folder / "notes.txt").read_text() == "mine"
    import reshard_svc

    assert reshard_svc.verify(str(folder / "ckpt-tp8")).ok
    assert reshard_svc.inspect(str(folder / "ckpt-tp2")).tensors  # the job's result, kept
