"""Overlap mode and the torn-snapshot guard, in one process on CPU.

``CheckpointManager(..., optimizers=[opt])``: ``save`` returns once the snapshot's copies
are queued (for CPU state that is copied, not forked: ``RESHARD_ASYNC_FORK=0``, on the
stager's side thread) and the optimizer's step pre-hook waits for them. Each committed
step holds exactly what the job held when it called ``save``. A tensor changed in place
before its copy finished (here: a copy slowed down, then ``add_`` without waiting) makes
that step not count, on both tiers, with one warning naming it; the previous step stays
the resume point and the next step saves."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import reshard_svc
from reshard_svc import CheckpointManager, FastTier, UsageError
from reshard_svc.format.steps import step_name
from reshard_svc.runtime import staging


@pytest.fixture(autouse=True)
def _copying_stager(monkeypatch):
    monkeypatch.setenv("RESHARD_ASYNC_FORK", "0")  # CPU state copied: the path that overlaps


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _stage_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("reshard-stage")]


def test_overlap_mode_commits_what_the_job_held_at_each_save(tmp_path):
    model, opt = _model()
    held = {}
    with CheckpointManager(str(tmp_path / "root"), optimizers=[opt]) as mgr:
        for step in range(1, 6):
            loss = model(torch.randn(16, 64)).square().mean()
            loss.backward()
            state = {"model": model.state_dict(), "step": step}
            held[step] = {k: v.clone() for k, v in model.state_dict().items()}
            assert mgr.save(step, state)
            opt.step()  # the hook waits for the copies first
            opt.zero_grad()
            assert mgr.last_wait_s >= 0.0
        mgr.wait()
        assert mgr.steps() == [1, 2, 3, 4, 5]
    assert _stage_threads() == []
    for step, want in held.items():
        got = {"model": {k: torch.empty_like(v) for k, v in want.items()}, "step": 0}
        with CheckpointManager(str(tmp_path / "root")) as mgr:
            assert mgr.load(got, step=step) == step
        for k, v in want.items():
            assert torch.equal(got["model"][k].view(torch.int32), v.view(torch.int32)), (step, k)


def _slow_copies(monkeypatch, seconds: float) -> None:
    real = staging._copy_then

    def slow(pairs, torn):
        time.sleep(seconds)
        return real(pairs, torn)

    monkeypatch.setattr(staging, "_copy_then", slow)


def _whole_then_torn(mgr, model, opt, monkeypatch) -> None:
    """Step 1 saved whole (the optimizer's hook waits for its copies); step 2's copies
    slowed down and a weight changed in place before they finish."""
    mgr.save(1, {"model": model.state_dict()})
    opt.step()  # waits: step 1 is whole
    mgr.wait()
    _slow_copies(monkeypatch, 0.5)
    mgr.save(2, {"model": model.state_dict()})
    with torch.no_grad():
        model[0].weight.add_(1.0)  # in place, without waiting for the copies
    mgr.wait()


def test_a_tensor_changed_before_its_copy_finished_makes_the_step_not_count(
    tmp_path, monkeypatch, caplog
):
    model, opt = _model()
    fast = FastTier(str(tmp_path / "fast"), every=1)
    root = str(tmp_path / "root")
    with caplog.at_level(logging.WARNING, logger="reshard_svc"):
        with CheckpointManager(root, optimizers=[opt], fast=fast) as mgr:
            _whole_then_torn(mgr, model, opt, monkeypatch)
            assert mgr.steps() == [1] and mgr.fast_steps() == [1]
            monkeypatch.undo()
            monkeypatch.setenv("RESHARD_ASYNC_FORK", "0")
            mgr.save(3, {"model": model.state_dict()})
            opt.step()
            mgr.wait()
            assert mgr.steps() == [1, 3] and mgr.fast_steps() == [1, 3]
    said = [r.getMessage() for r in caplog.records if "does not count" in r.getMessage()]
    assert len(said) == 2, said  # one per tier
    assert all("model.0.weight" in m and "changed in place" in m for m in said), said
    got = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    with CheckpointManager(root) as mgr:
        assert mgr.load(got) == 3
    assert torch.equal(got["model"]["0.weight"], model[0].weight.detach())


def test_a_torn_last_step_is_reported_once_and_the_manager_closes_cleanly(
    tmp_path, monkeypatch, caplog
):
    """The job's last save is torn: one warning, the step does not count, and leaving the
    ``with`` does not raise it again (seen on a GPU host: close re-raised what ``wait``
    had already reported)."""
    model, opt = _model()
    root = str(tmp_path / "root")
    with caplog.at_level(logging.WARNING, logger="reshard_svc"):
        with CheckpointManager(root, optimizers=[opt]) as mgr:
            _whole_then_torn(mgr, model, opt, monkeypatch)
            assert mgr.steps() == [1]
    said = [r.getMessage() for r in caplog.records if "does not count" in r.getMessage()]
    assert len(said) == 1 and "model.0.weight" in said[0], said
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1]


def test_async_save_with_overlap_refuses_a_torn_snapshot(tmp_path, monkeypatch):
    from reshard_svc.runtime.async_save import AsyncSaver

    w = torch.arange(4096, dtype=torch.float32)
    saver = AsyncSaver()
    try:
        _slow_copies(monkeypatch, 0.3)
        future = saver.save({"w": w}, str(tmp_path / "torn"), overlap=True)
        w.mul_(2)
        with pytest.raises(reshard_svc.TornSnapshotError, match="'w' changed in place") as e:
            future.result()
        assert e.value.tensors == ["w"]
        assert not (tmp_path / "torn" / "reshard.index.json").exists()
        future = saver.save({"w": w}, str(tmp_path / "whole"), overlap=True)
        assert saver.finish_copies() == []
        w.mul_(2)  # after the copies: the checkpoint holds the values at save time
        future.result()
    finally:
        saver.close()
    got = {"w": torch.empty_like(w)}
    reshard_svc.load(got, str(tmp_path / "whole"))
    assert torch.equal(got["w"], w / 2)
    assert _stage_threads() == []


def test_optimizers_that_take_no_hook_are_refused_before_the_root_is_taken(tmp_path):
    with pytest.raises(UsageError, match="optimizers: object takes no step pre-hook"):
        CheckpointManager(str(tmp_path / "root"), optimizers=[object()])
    with CheckpointManager(str(tmp_path / "root")) as mgr:  # the root is free
        assert mgr.steps() == []


def _counting_copies(monkeypatch) -> list[int]:
    """Bytes copied into staging buffers, one entry per stage that copied."""
    real, copied = staging._copy_then, []

    def counting(pairs, torn):
        copied.append(sum(buf.numel() * buf.element_size() for buf, _ in pairs))
        return real(pairs, torn)

    monkeypatch.setattr(staging, "_copy_then", counting)
    return copied


def test_a_step_due_on_both_tiers_is_staged_once(tmp_path, monkeypatch):
    """The manager's two tiers share one stager: a step due on both copies each byte once,
    and each tier commits exactly what the job held at that step."""
    copied = _counting_copies(monkeypatch)
    w = torch.arange(1 << 14, dtype=torch.float32)
    nbytes = w.numel() * w.element_size()
    fast = FastTier(str(tmp_path / "fast"), every=1)
    root = str(tmp_path / "root")
    with CheckpointManager(root, interval=2, fast=fast) as mgr:
        for step in range(1, 5):
            w.add_(1)
            assert mgr.save(step, {"w": w}).saved == (step % 2 == 0)
            mgr.wait()
        assert mgr.steps() == [2, 4] and mgr.fast_steps() == [3, 4]
    assert copied == [nbytes] * 4, copied  # steps 2 and 4 went to both tiers, staged once
    got = {"w": torch.empty_like(w)}
    reshard_svc.load(got, f"{root}/{step_name(2)}")
    assert torch.equal(got["w"], torch.arange(1 << 14, dtype=torch.float32) + 2)
    with CheckpointManager(root, fast=fast) as mgr:
        assert mgr.load(got) == 4 and mgr.last_restore.tier == "fast"
    assert torch.equal(got["w"], w)


def test_a_stage_while_the_last_one_is_still_written_gets_buffers_of_its_own(tmp_path, monkeypatch):
    """The persistent tier still writes step 2 (shared with the fast tier) when step 3 is
    staged for the fast tier: step 3 gets new buffers, step 2 commits the values of step 2,
    and no buffer is touched after its release (RESHARD_DEBUG_BUFFERS=1 poisons them)."""
    from reshard_svc.runtime import async_save

    monkeypatch.setenv("RESHARD_DEBUG_BUFFERS", "1")
    real, writing = async_save.write_and_commit, threading.Event()

    def slow(prep, comm, write_here):
        writing.set()
        time.sleep(1.0)  # step 3 is staged meanwhile
        return real(prep, comm, write_here)

    monkeypatch.setattr(async_save, "write_and_commit", slow)
    w = torch.zeros(1 << 14, dtype=torch.float64)
    fast = FastTier(str(tmp_path / "fast"), every=1)
    root = str(tmp_path / "root")
    with CheckpointManager(root, interval=2, fast=fast, if_busy="defer") as mgr:
        for step in range(1, 4):
            w.fill_(step)
            mgr.save(step, {"w": w})
            if step == 2:
                assert writing.wait(10)
        mgr.wait()
        assert mgr.steps() == [2] and mgr.fast_steps() == [2, 3]
    got = {"w": torch.empty_like(w)}
    reshard_svc.load(got, f"{root}/{step_name(2)}")
    assert torch.equal(got["w"], torch.full_like(w, 2))
    with CheckpointManager(root, fast=fast) as mgr:
        assert mgr.load(got) == 3
    assert torch.equal(got["w"], torch.full_like(w, 3))


def test_a_shared_stage_is_given_back_when_its_last_writer_releases_it(monkeypatch):
    from reshard_svc.layout import Box
    from reshard_svc.runtime.buffers import POISON
    from reshard_svc.runtime.targets import Placed

    monkeypatch.setenv("RESHARD_DEBUG_BUFFERS", "1")
    w = torch.arange(64, dtype=torch.int32)
    box = Box((0,), (64,))
    placed = {"w": Placed(name="w", dtype=w.dtype, shape=(64,), layout=None, local={box: w})}
    stager, key = staging.Stager("a test"), object()
    first = stager.stage(placed, fork=False, share=key)
    second = stager.stage(placed, fork=False, share=key)
    buf = first.placed["w"].local[box]
    assert second.placed["w"].local[box] is buf and buf is not w
    other = stager.stage(placed, fork=False, share=object())  # another save: its own buffers
    assert other.placed["w"].local[box] is not buf
    first.release()
    assert torch.equal(buf, w)  # the second writer still holds it
    second.release()
    second.release()  # once only
    assert bool((buf.view(torch.uint8) == POISON).all())
    other.release()
    stager.close()


def test_a_sharing_scope_holds_its_stage_until_every_writer_has_staged(monkeypatch):
    """The fast tier may finish writing before the persistent tier stages the same step:
    the manager's sharing scope keeps the stage (one copy), given back after both."""
    from reshard_svc.layout import Box
    from reshard_svc.runtime.buffers import POISON
    from reshard_svc.runtime.targets import Placed

    monkeypatch.setenv("RESHARD_DEBUG_BUFFERS", "1")
    copied = _counting_copies(monkeypatch)
    w = torch.arange(64, dtype=torch.int32)
    box = Box((0,), (64,))
    placed = {"w": Placed(name="w", dtype=w.dtype, shape=(64,), layout=None, local={box: w})}
    stager = staging.Stager("a test")
    with stager.sharing() as key:
        first = stager.stage(placed, fork=False, share=key)
        buf = first.placed["w"].local[box]
        first.release()  # the first writer is done before the second stages
        second = stager.stage(placed, fork=False, share=key)
        assert second.placed["w"].local[box] is buf and torch.equal(buf, w)
    assert copied == [256]
    assert torch.equal(buf, w)  # the second writer still holds it
    second.release()
    assert bool((buf.view(torch.uint8) == POISON).all())
    stager.close()
