"""The training engineer's journey: TP=4 training with torch's TP APIs, checkpoint with
reshard_svc, resume at TP=2 and on (dp=2, tp=2) with FSDP2 — exactly where it stopped."""

from __future__ import annotations

import pytest
import torch

import reshard_svc
from tests.support import training
from tests.support.harness import run

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("train") / "step3")
    res = run(training.first_run, 4, path)
    return path, (res[0]["saved"], res[0]["optim"]), res[0]["losses"]


def check_resume(res: dict, saved: tuple, want_losses: list[float]) -> None:
    params, optim = saved
    loaded = res[0]["loaded"]
    assert set(loaded) == set(params)
    for k in params:
        assert torch.equal(loaded[k], params[k]), k  # bitwise: nothing rounded on the way
    assert set(res[0]["optim"]) == set(optim)
    for k in optim:
        assert torch.equal(res[0]["optim"][k], optim[k]), k
    assert res[0]["step"] == 3
    for r in res.values():
        assert r["losses"] == pytest.approx(want_losses, rel=1e-5)


def test_resume_at_tp2(first):
    path, saved, losses = first
    check_resume(run(training.resume, 2, path, 2), saved, losses)


def test_resume_on_2d_mesh_with_fsdp2(first):
    path, saved, losses = first
    check_resume(run(training.resume, 4, path, 2, 2), saved, losses)


def test_resume_after_offline_convert_to_tp2(first, tmp_path):
    path, saved, losses = first
    tp2 = str(tmp_path / "tp2")
    reshard_svc.convert(path, tp2, mesh="tp=2")
    assert reshard_svc.inspect(tp2).tensors[
        "model.layers.0.attention.wq.weight"
    ].layout.mesh.shape == (2,)
    check_resume(run(training.resume, 2, tp2, 2), saved, losses)


def test_async_save_snapshots_at_call_time(tmp_path):
    res = run(training.async_snapshot, 2, str(tmp_path / "async"))
    for r in res.values():
        assert r["same"], "the checkpoint picked up changes made after async_save returned"
        assert r["error"] is not None, "an unwritable target did not raise"
    # rank 0 names the storage error; the other ranks learn that a peer failed
    assert res[0]["error"] == "MissingFileError", res
    assert reshard_svc.verify(str(tmp_path / "async")).ok


def test_save_from_fsdp2_2d_mesh_and_resume_at_tp2(first, tmp_path):
    path, saved, losses = first
    resaved = str(tmp_path / "from-fsdp")
    run(training.fsdp_resave, 4, path, resaved)
    assert reshard_svc.verify(resaved).ok
    check_resume(run(training.resume, 2, resaved, 2), saved, losses)
