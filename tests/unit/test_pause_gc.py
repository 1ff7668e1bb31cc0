"""The collector pause around index parsing and convert: off inside, restored after."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import reshard_svc
from reshard_svc._collector import collector_paused
from reshard_svc.errors import CheckpointError


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_inside_restored_after_even_on_error():
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the inner exit leaves it off
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_freeze_moves_what_is_alive_to_the_permanent_generation():
    gc.unfreeze()
    try:
        with collector_paused(freeze=True):
            keep = [object() for _ in range(1000)]
        assert gc.get_freeze_count() >= len(keep)
    finally:
        gc.unfreeze()


def test_convert_runs_with_the_collector_off_and_restores_it(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    sd = {f"w{i}": torch.randn(64, 8) for i in range(50)}
    reshard_svc.save(sd, src)
    during: list[bool] = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection would free goes to gc.garbage
    try:
        res = reshard_svc.convert(
            src,
            dst,
            mesh="tp=1",
            max_memory="8KiB",
            progress=lambda _: during.append(gc.isenabled()),
        )
        assert gc.isenabled()
        gc.collect()
        # With the collector paused, only reference cycles could outlive their use:
        # a run of many waves must leave none (no buffer or tensor kept by a cycle).
        ours = [  # other tests' threads may drop garbage of their own meanwhile
            o
            for o in gc.garbage
            if isinstance(o, (torch.Tensor, bytearray, memoryview))
            or type(o).__module__.startswith("reshard_svc")
        ]
        assert res.waves > 10 and ours == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert during and not any(during)  # off for the whole run (progress comes mid-run)
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    reshard_svc.load(back, dst)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(CheckpointError):
        reshard_svc.convert(str(tmp_path / "missing"), str(tmp_path / "out"), mesh="tp=1")
    assert gc.isenabled()


def test_index_parsing_runs_with_the_collector_off(tmp_path, monkeypatch):
    import reshard_svc.format.index as index_mod

    reshard_svc.save({"w": torch.ones(4)}, str(tmp_path / "c"))
    raw = (tmp_path / "c" / index_mod.INDEX_NAME).read_bytes()
    real, during = index_mod.json.loads, []

    def spy(data, *a, **kw):
        during.append(gc.isenabled())
        return real(data, *a, **kw)

    monkeypatch.setattr(index_mod.json, "loads", spy)
    assert "w" in index_mod.CheckpointIndex.loads(raw).tensors
    assert during == [False] and gc.isenabled()


def test_settle_moves_what_the_body_left_to_the_oldest_generation_and_thaws_nothing():
    gc.unfreeze()
    gc.collect()
    with collector_paused(settle=True):
        kept = [[i] for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(o) in oldest for o in kept)  # not walked by a young collection
    assert gc.get_count()[0] < 100
    # a cycle made inside is still collected, by a full collection
    with collector_paused(settle=True):
        cycle: list = []
        cycle.append(cycle)
        ref = weakref.ref(Node(cycle))
    del cycle
    gc.collect()
    assert ref() is None
    # where something is frozen (the worker freezes its imports) nothing is thawed
    try:
        with collector_paused(freeze=True):
            frozen = [[] for _ in range(100)]
        before = gc.get_freeze_count()
        with collector_paused(settle=True):
            more = [[] for _ in range(100)]
        assert gc.get_freeze_count() == before and frozen and more
    finally:
        gc.unfreeze()


class Node:
    """A weakly referenceable object held by a cycle."""

    def __init__(self, cycle: list) -> None:
        cycle.append(self)
