"""The fast tier in one process: a full fast path, two jobs on one fast path, bad settings,
and the copy placement across nodes."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import reshard_svc
from reshard_svc.errors import TargetBusyError, UsageError
from reshard_svc.sessions.fast import peers


def _state(step: int, rows: int = 256) -> dict:
    return {"w": torch.arange(rows * 256, dtype=torch.float32).reshape(rows, 256) + step, "n": step}


def test_copies_go_to_other_nodes_at_the_same_position():
    assert peers([0, 0, 1, 1], 2) == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert peers([0, 0, 1, 1, 2, 2], 3) == {
        0: [2, 4],
        1: [3, 5],
        2: [4, 0],
        3: [5, 1],
        4: [0, 2],
        5: [1, 3],
    }
    assert peers([0, 0, 0, 1], 2) == {0: [3], 1: [3], 2: [3], 3: [0]}
    assert peers([0, 0], 2) == {0: [], 1: []}  # one node: no other node to copy to


@pytest.mark.parametrize(
    "kw", [{"every": 0}, {"every": 1, "copies": 0}, {"every": 1, "node": -1}, {"every": True}]
)
def test_bad_settings_name_what_to_fix(tmp_path, kw):
    with pytest.raises(UsageError, match="FastTier"):
        reshard_svc.FastTier(str(tmp_path / "fast"), **kw)
    with pytest.raises(UsageError, match="local folder"):
        reshard_svc.FastTier("s3://bucket/fast", every=1)


def test_two_jobs_on_one_fast_path_the_second_is_refused_naming_the_first(tmp_path):
    fast = reshard_svc.FastTier(str(tmp_path / "fast"), every=1)
    with reshard_svc.CheckpointManager(str(tmp_path / "a"), fast=fast):
        with pytest.raises(TargetBusyError, match="fast-tier") as e:
            reshard_svc.CheckpointManager(str(tmp_path / "b"), fast=fast)
        assert str(os.getpid()) in str(e.value)
        # the refused job took nothing: its own root is free again
        reshard_svc.CheckpointManager(str(tmp_path / "b")).close()


def test_the_newest_fast_step_is_loaded_when_newer_than_the_roots(tmp_path):
    fast = reshard_svc.FastTier(str(tmp_path / "fast"), every=1)
    with reshard_svc.CheckpointManager(str(tmp_path / "root"), interval=3, fast=fast) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == [3] and mgr.fast_steps() == [4, 5]
    got = _state(-1)
    with reshard_svc.CheckpointManager(str(tmp_path / "root"), fast=fast) as mgr:
        assert mgr.load(got) == 5
        info = mgr.last_restore
    assert torch.equal(got["w"], _state(5)["w"]) and got["n"] == 5
    assert (info.tier, info.step, info.bytes_persistent) == ("fast", 5, 0)
    assert info.bytes_local == 256 * 256 * 4 and info.bytes_peer == 0


@pytest.fixture
def tiny_tmpfs(small_tmpfs):
    return small_tmpfs("64k")


def test_a_full_fast_path_is_a_warning_and_training_goes_on(tmp_path, tiny_tmpfs, caplog):
    fast = reshard_svc.FastTier(str(tiny_tmpfs / "fast"), every=1)
    with caplog.at_level(logging.WARNING, logger="reshard_svc.sessions.fast"):
        with reshard_svc.CheckpointManager(str(tmp_path / "root"), interval=2, fast=fast) as mgr:
            for step in range(1, 5):
                mgr.save(step, _state(step))  # 256 KiB of state: more than the tmpfs holds
            mgr.wait()
            assert mgr.steps() == [2, 4] and mgr.fast_steps() == []
    assert any("does not count" in r.getMessage() for r in caplog.records)
    got = _state(-1)
    with reshard_svc.CheckpointManager(str(tmp_path / "root"), fast=fast) as mgr:
        assert mgr.load(got) == 4 and mgr.last_restore.tier == "persistent"
    assert torch.equal(got["w"], _state(4)["w"])


def test_a_forced_save_of_a_step_the_fast_tier_holds_keeps_it_counted(tmp_path, caplog):
    fast = reshard_svc.FastTier(str(tmp_path / "fast"), every=2)
    with caplog.at_level(logging.WARNING, logger="reshard_svc.sessions.fast"):
        with reshard_svc.CheckpointManager(str(tmp_path / "root"), interval=10, fast=fast) as mgr:
            for step in (1, 2):
                mgr.save(step, _state(step))
            mgr.save(2, _state(2), force=True)  # a final save at a step the fast tier has
            mgr.wait()
            assert mgr.fast_steps() == [2] and mgr.steps() == [2]
    assert not [r for r in caplog.records if "does not count" in r.getMessage()]


def test_an_unfinished_fast_step_is_written_again_whole(tmp_path):
    """A part left by an attempt that did not count (here: planted) is replaced."""
    from reshard_svc.format.fast import fast_steps

    fast = reshard_svc.FastTier(str(tmp_path / "fast"), every=1)
    with reshard_svc.CheckpointManager(str(tmp_path / "root"), interval=10, fast=fast) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        (done,) = fast_steps(str(tmp_path / "fast"))
        os.remove(os.path.join(done.folder, "commit.json"))  # as if it never counted
        mgr._fast._counted = None  # noqa: SLF001 (the attempt did not count)
        mgr.save(1, _state(7))
        mgr.wait()
        assert mgr.fast_steps() == [1]
    got = _state(-1)
    with reshard_svc.CheckpointManager(str(tmp_path / "root"), fast=fast) as mgr:
        assert mgr.load(got) == 1
    assert torch.equal(got["w"], _state(7)["w"])


def test_a_stop_signal_saves_a_fast_step_first_then_the_root(tmp_path):
    import signal

    fast = reshard_svc.FastTier(str(tmp_path / "fast"), every=100)
    with reshard_svc.CheckpointManager(
        str(tmp_path / "root"), interval=100, fast=fast, save_on_signals=[signal.SIGUSR1]
    ) as mgr:
        mgr.save(1, _state(1))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mgr.save(2, _state(2)) and mgr.should_stop  # neither tier was due at step 2
        assert mgr.fast_steps() == [2] and mgr.steps() == [2]
