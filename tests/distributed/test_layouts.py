"""Every layout a real job uses: pipeline stages that pass their own keys, expert parallel
on an (ep, tp) mesh with plain local experts, and replicas that must agree.

Real gloo processes; tensors compared bitwise with the ones the job itself held
(``full_tensor()`` of its DTensors).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import pipeline
from tests.support.cli import reshard
from tests.support.harness import run

pytestmark = pytest.mark.distributed


def merged(res: dict, key: str) -> dict[str, torch.Tensor]:
    """One full tensor per name, from the first rank of each stage."""
    out: dict[str, torch.Tensor] = {}
    for r in res.values():
        for k, v in (r[key] or {}).items():
            assert k not in out or torch.equal(out[k], v), k
            out[k] = v
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    return [k for k in want if not torch.equal(got[k], want[k])]


@pytest.fixture(scope="module")
def pp_ckpt(tmp_path_factory):
    """2 stages x TP 2 on 4 ranks: each stage saves its own layers, DTensors on its own TP
    sub-mesh; then one more step (what a resume must reproduce)."""
    path = str(tmp_path_factory.mktemp("pp") / "step2")
    res = run(pipeline.pp_save, 4, path, 2, 2)
    keys = {r["stage"]: set(r["keys"]) for r in res.values()}
    assert keys[0] and keys[1] and not keys[0] & keys[1]  # really per-stage key sets
    return path, merged(res, "saved"), merged(res, "after")


def test_pp_tp_checkpoint_loads_at_tp3_without_pp(pp_ckpt):
    path, saved, _ = pp_ckpt
    res = run(pipeline.flat_load, 3, path, 3)
    assert same(res[0]["loaded"], saved) == []


def test_pp_tp_checkpoint_loads_at_another_pp_tp_with_plain_tensors(pp_ckpt, tmp_path):
    """2 stages x TP 1: each stage holds plain tensors. Load, then save again from there
    (plain tensors, per-stage keys) and load that at TP 2 without PP."""
    path, saved, _ = pp_ckpt
    res = run(pipeline.pp_resume, 2, path, 2, 1)
    assert same(merged(res, "loaded"), saved) == []
    again = str(tmp_path / "pp2-tp1")
    res = run(pipeline.pp_save, 2, again, 2, 1)
    again_saved = merged(res, "saved")
    assert same(run(pipeline.flat_load, 2, again, 2)[0]["loaded"], again_saved) == []


def test_pp_tp_resume_continues_exactly(pp_ckpt):
    path, saved, after = pp_ckpt
    res = run(pipeline.pp_resume, 4, path, 2, 2)
    assert all(r["step"] == 2 for r in res.values())
    assert same(merged(res, "loaded"), saved) == []
    assert same(merged(res, "after"), after) == []  # the same next step, bit for bit


def test_cli_converts_a_pp_checkpoint(pp_ckpt, tmp_path):
    path, saved, _ = pp_ckpt
    out = str(tmp_path / "tp3")
    r = reshard("convert", path, out, "--mesh", "tp=3", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert reshard("verify", out).returncode == 0
    assert same(run(pipeline.flat_load, 3, out, 3)[0]["loaded"], saved) == []


@pytest.fixture(scope="module")
def ep_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ep") / "experts")
    run(pipeline.ep_save, 4, path, 2, 2)
    return path


@pytest.mark.parametrize(
    ("world", "ep", "tp", "replicated"),
    [(2, 1, 2, False), (4, 4, 1, False), (3, 3, 1, False), (2, 2, 1, True)],
)
def test_expert_parallel_loads_at_other_ep_tp(ep_ckpt, world, ep, tp, replicated):
    res = run(pipeline.ep_load, world, ep_ckpt, ep, tp, replicated)
    for rank, ok in res.items():
        assert ok == {"moe.w1": True, "moe.w2": True}, rank


@pytest.mark.parametrize("case", ["plain", "dtensor", "extras", "async"])
def test_divergent_replicas_are_refused_with_nothing_committed(tmp_path, case):
    path = str(tmp_path / "ck")
    res = run(pipeline.divergent, 2, path, case)
    for rank, r in res.items():
        assert r["error"] is not None and "UNEXPECTED" not in r["error"], (rank, r)
        assert "differ" in r["error"] and "per-rank keys" in r["error"]
        assert r["left"] == [], r["left"]  # no checkpoint, no staging data, no lease
    if case in ("plain", "async"):
        assert "'experts.w'" in res[0]["error"] and "rank(s) 0" in res[0]["error"]
        assert "rank(s) 1" in res[0]["error"]


@pytest.mark.parametrize("case", ["same", "unchecked"])
def test_identical_replicas_and_an_explicit_opt_out_are_saved(tmp_path, case):
    import reshard_svc

    path = str(tmp_path / "ck")
    res = run(pipeline.divergent, 2, path, case)
    assert all(r["error"] is None for r in res.values()), res
    got = {"experts.w": torch.zeros(2, 4)}
    reshard_svc.load(got, path)
    if case == "same":
        assert torch.equal(got["experts.w"], torch.ones(2, 4))
    else:  # one holder's copy, as asked
        assert got["experts.w"].unique().numel() == 1
    assert sorted(os.listdir(tmp_path)) == ["ck"]
