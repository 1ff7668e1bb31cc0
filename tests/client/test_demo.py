"""``make demo`` (the main job) runs end to end: server, CLI submit, verify, bitwise check."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.distributed
def test_demo_runs_end_to_end():
    r = subprocess.run(
        [sys.executable, "-m", "reshard_client.demo"], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bitwise equal to the originals: yes" in r.stdout
    assert "succeeded" in r.stdout
