"""Bounded memory and crash safety of convert, on real worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import reshard_svc
from reshard_svc.errors import NotACheckpointError
from tests.support import workloads
from tests.support.harness import run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MiB = 2**20


def big_source(path: str, mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = mib * MiB // 4 // 4  # four fp32 tensors
    sd = {f"w{i}": torch.randn(n // 256, 256, generator=g) for i in range(4)}
    reshard_svc.save(sd, path + "-plain")
    reshard_svc.convert(path + "-plain", path, mesh="tp=4", rules={"w0": "S(1)", "*": "S(0)"})
    return sd


def test_peak_memory_follows_the_budget_not_the_checkpoint(tmp_path):
    src = str(tmp_path / "src")
    sd = big_source(src, 160)  # 160 MiB checkpoint: each worker writes 80 MiB
    budget = 8 * MiB
    res = run(
        workloads.convert_stage,
        2,
        src,
        str(tmp_path / "dst"),
        {
            "mesh": "tp=2",
            "rules": {"w0": "S(0)", "*": "S(1)"},
            "max_memory": budget,
            "strategy": "exchange",
        },
    )
    for r in res.values():
        growth = r["peak_rss_mb"] - r["rss_before_mb"]
        # Twice the budget (the peak counts the page-cache pages of the verified source
        # maps, which slabs waiting for their writes keep mapped) + fixed overhead: far
        # below the 80 MiB each worker writes.
        assert growth < 2 * budget / MiB + 24, r
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reshard_svc.load(out, str(tmp_path / "dst"))
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_killed_worker_leaves_no_target_and_rerun_succeeds(tmp_path):
    src = str(tmp_path / "src")
    big_source(src, 64)
    dst = str(tmp_path / "dst")
    progress = str(tmp_path / "progress.jsonl")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "reshard_svc.worker",
        "convert",
        src,
        dst,
        "--mesh",
        "tp=2",
        "--rules",
        json.dumps({"*": "S(1)"}),
        "--max-memory",
        "256KiB",
        "--strategy",
        "exchange",
        "--progress-file",
        progress,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (os.path.exists(progress) and os.path.getsize(progress)):
        assert proc.poll() is None and time.monotonic() < deadline, (
            "convert ended before any progress"
        )
        time.sleep(0.02)
    workers = subprocess.run(
        ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert workers, "no worker processes found"
    os.kill(int(workers[0]), signal.SIGKILL)
    assert proc.wait(120) != 0
    with pytest.raises(NotACheckpointError):
        reshard_svc.inspect(dst)
    assert not os.path.exists(dst)
    # The same command again commits a complete, verified target.
    os.remove(progress)
    assert (
        subprocess.run(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300
        ).returncode
        == 0
    )
    assert reshard_svc.verify(dst).ok
    assert json.loads(open(progress).read().splitlines()[-1])["event"] == "done"
