"""``reshard plan``: a dry run with the planner the workers run — its figures are what a
real ``reshard convert --workers 2`` then does; a load on 4,096 ranks plans on one machine."""

from __future__ import annotations

import json

import torch

import reshard_svc
from tests.support.cli import reshard


def checkpoint(tmp_path) -> str:
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(256, 64, generator=g), "norm": torch.randn(64, generator=g)}
    reshard_svc.save(sd, str(tmp_path / "plain"))
    src = str(tmp_path / "tp4")
    reshard_svc.convert(str(tmp_path / "plain"), src, mesh="tp=4", rules={"w": "S(0)", "norm": "R"})
    return src


def test_the_dry_run_says_what_the_workers_then_do(tmp_path):
    src = checkpoint(tmp_path)
    args = ["--mesh", "tp=2", "--rules", '{"w": "S(1)", "norm": "R"}', "--strategy", "exchange"]
    r = reshard("plan", src, *args, "--world", "2", "--json")
    assert r.returncode == 0, r.stderr
    planned = json.loads(r.stdout)
    r = reshard("convert", src, str(tmp_path / "out"), *args, "--workers", "2", "--json")
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout.strip().splitlines()[-1])
    assert planned["strategy"] == done["strategy"] == "exchange"
    assert planned["sent"]["total"] == planned["received"]["total"] == done["bytes_exchanged"]
    assert planned["read"]["total"] == 256 * 64 * 4 + 64 * 4  # each stored byte once
    assert done["bytes_read"] >= planned["read"]["total"]  # reads widen to whole CRC blocks
    assert planned["world"] == 2 and planned["tensors"] == 2 and planned["waves"] >= 1
    assert planned["peak_memory"]["max"] <= planned["budget"]
    r = reshard("plan", src, *args, "--world", "2")
    assert r.returncode == 0 and "read from storage" in r.stdout and "peak in flight" in r.stdout


def test_a_load_on_4096_ranks_plans_here_with_its_replicas_fed_once(tmp_path):
    src = checkpoint(tmp_path)
    r = reshard(
        "plan",
        src,
        "--mesh",
        "tp=4096",
        "--rules",
        '{"w": "S(0)", "norm": "R"}',
        "--load",
        "--strategy",
        "exchange",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["mode"] == "load" and got["world"] == 4096
    # every rank gets its rows of w, and all of norm (replicated)
    assert got["bytes_total"] == 256 * 64 * 4 + 64 * 4 * 4096
    assert got["read"]["total"] == 256 * 64 * 4 + 64 * 4  # each stored byte read once
    # norm's single stored copy: one reader, every other rank receives it exactly once
    assert got["received"]["max"] <= 64 * 4 + 64 * 4


def test_bad_plans_name_what_to_fix(tmp_path):
    src = checkpoint(tmp_path)
    r = reshard("plan", src, "--load")
    assert r.returncode == 2 and "--mesh" in r.stderr and "Traceback" not in r.stderr
    r = reshard("plan", src, "--mesh", "tp=4", "--load", "--world", "3")
    assert r.returncode == 2 and "runs on 4 ranks" in r.stderr
    r = reshard("plan", str(tmp_path / "nothing"), "--world", "2")
    assert r.returncode == 2 and "does not exist" in r.stderr
