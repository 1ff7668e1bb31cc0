"""The README's benchmark commands, each run as written plus its smoke-size flags (the
script in a process of its own forked from the session's preloaded forkserver, as
``python SCRIPT`` runs it: :mod:`tests.support.cli`).

The full sizes take minutes and gigabytes; the small ones go through the same code paths
(torchrun workers, our operation and its baseline in the same run) and print the same JSON.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import python
from tests.support.docs import REPO, block

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def bench_commands() -> list[list[str]]:
    cmds = [shlex.split(line, comments=True) for line in block("bench", "bash").splitlines()]
    return [c for c in cmds if c]


#: Benches whose workers start through ``common.launch``: the smoke runs start them from a
#: forkserver (the same workers and timed regions; a launch in under a second, not ~9 s of
#: imports). recovery.py keeps ``torchrun``, so the default launcher is run too.
FORKSERVER = {
    "bench/save_load.py",
    "bench/convert.py",
    "bench/async_save.py",
    "bench/training_loop.py",
    "bench/transfer.py",
    "bench/mlperf_checkpoint.py",
}


def smoke_flags(script: str, scratch: Path, cmd: list[str] = ()) -> list[str]:
    launcher = ["--launcher", "forkserver"] if script in FORKSERVER else []
    return [*_smoke_flags(script, scratch, cmd), *launcher]


def _smoke_flags(script: str, scratch: Path, cmd: list[str] = ()) -> list[str]:
    if script == "bench/plan.py":
        return ["--layers", "2", "--torch-ranks", "1", "--moe-layers", "1", "--runs", "1"]
    if script == "bench/transfer.py":
        return ["--size", "small", "--runs", "1"]
    if script == "bench/save_load.py" and "--ops" in cmd:  # the host case: as written
        return ["--size", "small", "--runs", "1", "--dir", str(scratch)]
    if script == "bench/save_load.py":  # the variants and the other loads: the same code
        return [
            "--size",
            "small",
            "--runs",
            "1",
            "--variants",
            "defaults",
            "--ops",
            "save,tp",
            "--dir",
            str(scratch),
        ]
    if script == "bench/convert.py":
        return ["--size", "small", "--runs", "1", "--variants", "defaults", "--dir", str(scratch)]
    if script == "bench/mlperf_checkpoint.py":  # the rules' code, on 2 ranks
        return ["--size", "small", "--runs", "1", "--ranks", "2", "--dir", str(scratch)]
    if script == "bench/gpu_host.py":  # no GPU here: the same cases on CPU tensors
        disk = str(scratch) + "-disk"
        return [
            "--gib",
            "0.03125",
            "--runs",
            "1",
            "--compute",
            "0.05",
            "--dir",
            str(scratch),
            "--disk",
            disk,
        ]
    if script == "bench/cli_convert.py":
        return ["--size", "small", "--runs", "1", "--dirs", str(scratch)]
    return ["--size", "small", "--runs", "1", "--dir", str(scratch)]


CMDS = bench_commands()


def test_readme_lists_the_benches():
    scripts = {c[1] for c in CMDS}
    assert {
        "bench/plan.py",
        "bench/save_load.py",
        "bench/convert.py",
        "bench/cli_convert.py",
        "bench/async_save.py",
        "bench/transfer.py",
    } <= scripts, scripts


@pytest.mark.parametrize("cmd", CMDS, ids=[c[1] for c in CMDS])
def test_readme_bench_command_prints_json(cmd, tmp_path):
    if cmd[0] != ".venv/bin/python":
        raise AssertionError(f"unexpected README bench command {cmd}")
    script = cmd[1]
    r = python(*cmd[1:], *smoke_flags(script, tmp_path / "scratch", cmd), cwd=REPO, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, r.stdout
    name = Path(script).stem
    assert all(line["bench"] == name for line in lines), lines
    summary = lines[-1]
    # each bench reports against a baseline measured in the same run
    assert any(
        k.endswith(("_over_dcp", "_over_cp", "_vs_torch_all_ranks", "_over_floor"))
        or "over_dcp" in k
        or "dcp_" in k
        or k.startswith("gen1_over_ours")
        for k in summary
    ), summary
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())


def test_the_link_bench_runs_between_two_emulated_hosts(tmp_path):
    """docs/weight-sync.md's link bench (root: namespaces, a veth pair, tc), smoke-sized:
    the same JSON, its link named, and every namespace it made gone."""
    import os
    import shutil

    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("the link bench needs root and iproute2 (ip, tc)")
    (cmd,) = [shlex.split(line, comments=True) for line in block("link-bench", "bash").splitlines()]
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    r = python(*cmd[1:], "--size", "small", "--runs", "1", cwd=REPO, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    (summary,) = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert summary["bench"] == "transfer" and summary["link"] == "10gbit"
    assert summary["bitwise_equal"]  # raw or delta is the cost model's call, per link
    assert all(summary[k]["sent_over_full"] <= 1.01 for k in ("0.1%", "1%", "10%", "100%"))
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before
