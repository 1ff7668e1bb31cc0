"""Properties of the pure transfer planner on random meshes, layouts and fusions.

Each problem places a source mesh and a target mesh in one world (disjoint, overlapping or
identical rank ranges), fuses 1-3 sources along dim 0 into one target, and runs the plan
by hand on real tensors: every element of every target box must be written exactly once
per holder, from a rank that holds it, and equal the concatenated sources.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard_svc.errors import TransferError
from reshard_svc.layout import Box, Layout, Mesh, Replicate, Shard, StridedShard
from reshard_svc.plan.budget import Budget
from reshard_svc.plan.items import Held, Holdings
from reshard_svc.plan.transfer import Cat, plan_transfer

EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ISZ = 8  # float64: values are exact


@st.composite
def layouts(draw, ndim: int) -> Layout:
    mesh = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2))))
    placements = []
    for _ in mesh:
        kind = draw(st.sampled_from(["R", "S", "SS"])) if ndim else "R"
        dim = draw(st.integers(0, max(ndim - 1, 0)))
        if kind == "R":
            placements.append(Replicate())
        elif kind == "S":
            placements.append(Shard(dim))
        else:
            placements.append(StridedShard(dim, draw(st.integers(1, 3))))
    return Layout(Mesh(mesh), tuple(placements))


def side(shape: tuple[int, ...], layout: Layout, first_rank: int) -> Holdings:
    holders: dict[Box, list[int]] = {}
    for i, boxes in enumerate(layout.shards(shape)):
        for b in boxes:
            if not b.is_empty:
                holders.setdefault(b, []).append(first_rank + i)
    held = tuple(Held(box=b, holders=tuple(h)) for b, h in sorted(holders.items()))
    return Holdings(dtype="float64", itemsize=ISZ, shape=shape, held=held)


def moves(plan):
    """(read, piece, target, box of the piece in its source's own coordinates) of every
    piece of the plan."""
    for wave in plan.waves:
        reads = {r.id: r for r in wave.reads}
        for p in wave.pieces:
            r = reads[p.read]
            shift = [o - b for o, b in zip(r.origin.offsets, r.box.offsets)] if r.origin else None
            src_box = (
                Box(tuple(o + d for o, d in zip(p.box.offsets, shift)), p.box.sizes)
                if shift
                else p.box
            )
            yield r, p, plan.targets[p.target], src_box


@st.composite
def problems(draw):
    ndim = draw(st.integers(1, 3))
    rest = tuple(draw(st.integers(1, 5)) for _ in range(ndim - 1))
    parts = [(draw(st.integers(0, 9)), *rest) for _ in range(draw(st.integers(1, 3)))]
    src_layouts = [draw(layouts(ndim)) for _ in parts]
    dst_layout = draw(layouts(ndim))
    src_at = [draw(st.integers(0, 4)) for _ in parts]
    dst_at = draw(st.integers(0, 4))
    return parts, src_layouts, src_at, dst_layout, dst_at


def build(parts, src_layouts, src_at, dst_layout, dst_at):
    src = {
        f"s{i}": side(shape, lay, at)
        for i, (shape, lay, at) in enumerate(zip(parts, src_layouts, src_at))
    }
    target = (sum(p[0] for p in parts), *parts[0][1:])
    dst = {"t": side(target, dst_layout, dst_at)}
    names = {"t": Cat(tuple(src), dim=0)} if len(parts) > 1 else {"t": "s0"}
    world = max(
        [at + lay.mesh.size for at, lay in zip(src_at, src_layouts)]
        + [dst_at + dst_layout.mesh.size]
    )
    return src, dst, names, world


def _sl(box: Box):
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


@EXAMPLES
@given(problems(), st.integers(1, 5000))
def test_every_target_element_arrives_once_from_a_holder(problem, budget):
    src, dst, names, world = build(*problem)
    try:
        plan = plan_transfer(src, dst, names, world, Budget(budget))
    except TransferError as e:
        assert "raise max_memory" in str(e)
        return
    fulls = {
        n: torch.arange(math.prod(s.shape), dtype=torch.float64).reshape(s.shape) + 1000 * i
        for i, (n, s) in enumerate(src.items())
    }
    want = torch.cat(list(fulls.values()), dim=0)
    got = {
        (r, h.box): torch.full(h.box.sizes, float("nan"), dtype=torch.float64)
        for h in dst["t"].held
        for r in h.holders
    }
    count = {k: torch.zeros(k[1].sizes, dtype=torch.int64) for k in got}
    src_holders = {n: {h.box: h.holders for h in s.held} for n, s in src.items()}
    everything = list(moves(plan))
    for read, piece, target, src_box in everything:
        held = read.origin or read.box
        assert read.reader in src_holders[read.tensor][held]
        assert held.contains(src_box) and target.box.contains(piece.box)
        assert (read.reader == piece.dest) == (piece.dest in src_holders[read.tensor][held])
        values = fulls[read.tensor][_sl(src_box)]
        got[(piece.dest, target.box)][piece.box.slices_in(target.box)] = values
        count[(piece.dest, target.box)][piece.box.slices_in(target.box)] += 1
        assert piece.nbytes == piece.box.numel * ISZ
    for (rank, box), value in got.items():
        assert torch.equal(value, want[_sl(box)]), (rank, box)
        assert bool((count[(rank, box)] == 1).all())
    assert (
        sum(plan.sent)
        == sum(plan.received)
        == sum(p.nbytes for r, p, _, _ in everything if r.reader != p.dest)
    )
    assert sum(plan.copied) == sum(p.nbytes for r, p, _, _ in everything if r.reader == p.dest)
    assert plan.bytes_total == sum(p.nbytes for _, p, _, _ in everything)
    assert plan.tensors == ("t",)
    assert max(plan.peak) <= budget


@EXAMPLES
@given(problems())
def test_sending_spreads_over_replicas(problem):
    """Replaying the plan in order, each piece is sent by a holder with the least bytes
    sent so far, pieces a receiver holds itself are copied, never sent, and a box more
    ranks need than hold it is relayed: sent once by a holder, forwarded by receivers."""
    src, dst, names, world = build(*problem)
    plan = plan_transfer(src, dst, names, world, Budget(1 << 40))
    holders = {n: {h.box: h.holders for h in s.held} for n, s in src.items()}
    load = [0] * world
    boxes = {n: [h.box for h in s.held] for n, s in src.items()}

    def made(m):  # the planner's order: target box, source (Cat order), box, its holder
        read, piece, target, _ = m
        held = boxes[read.tensor].index(read.origin or read.box)
        return piece.target, int(read.tensor[1:]), held, target.holders.index(piece.dest)

    relayed = any(m[1].via >= 0 for m in moves(plan))
    for read, piece, target, _ in sorted(moves(plan), key=made):
        hs = holders[read.tensor][read.origin or read.box]
        if piece.dest in hs:
            assert read.reader == piece.dest and piece.via < 0
            continue
        if piece.via >= 0:  # relayed: the via is a receiver, the reader sends it once
            remote = [h for h in target.holders if h not in hs]
            assert piece.via in remote and len(remote) > len(hs) and read.reader in hs
            sender = read.reader if piece.dest == piece.via else piece.via
        else:
            if not relayed:  # a relay's load interleaves; without one, least loaded
                assert load[read.reader] == min(load[h] for h in hs)
            sender = read.reader
        load[sender] += piece.nbytes
    assert tuple(load) == plan.sent


def test_many_buckets_keep_whole_tensors_together():
    shape = (8, 4)
    lay = Layout(Mesh((2,)), (Shard(0),))
    src = {f"w{i}": side(shape, lay, 0) for i in range(6)}
    dst = {f"w{i}": side(shape, Layout(Mesh((2,)), (Shard(1),)), 2) for i in range(6)}
    per_tensor = 8 * 4 * ISZ  # each rank sends half, receives half, stages half
    plan = plan_transfer(src, dst, None, 4, Budget(2 * per_tensor))
    assert len(plan.waves) == 3
    for w in plan.waves:
        assert {plan.targets[p.target].tensor for p in w.pieces} == set(w.tensors)
        assert {r.tensor for r in w.reads} == set(w.tensors)
    assert plan.tensors == tuple(sorted(dst))


def _simple(shape=(4, 4), dtype="float64"):
    lay = Layout(Mesh((2,)), (Shard(0),))
    s = side(shape, lay, 0)
    return Holdings(dtype=dtype, itemsize=ISZ, shape=s.shape, held=s.held)


@pytest.mark.parametrize(
    ("src", "dst", "names", "text"),
    [
        ({"a": _simple()}, {"b": _simple()}, None, "needs source(s) 'b'"),
        ({"a": _simple(), "x": _simple()}, {"a": _simple()}, None, "'x' are used by no target"),
        ({"a": _simple((4, 5))}, {"a": _simple()}, None, "has shape (4, 4)"),
        ({"a": _simple(dtype="float32")}, {"a": _simple()}, None, "never converts dtypes"),
        ({"a": _simple()}, {"a": _simple()}, {"z": "a"}, "no rank passed a target"),
        (
            {"a": _simple(), "b": _simple()},
            {"t": _simple((8, 4))},
            {"t": Cat(("a", "b"), dim=2)},
            "out of range",
        ),
        (
            {"a": _simple(), "b": _simple()},
            {"t": _simple((8, 4))},
            {"t": Cat(("a", "b"), dim=1)},
            "has shape (8, 4)",
        ),
        ({"a": _simple()}, {"a": _simple()}, {"a": 3}, "must be a source name or a Cat"),
    ],
)
def test_mismatches_are_typed_errors(src, dst, names, text):
    with pytest.raises(TransferError) as e:
        plan_transfer(src, dst, names, 4, Budget(1 << 30))
    assert text in str(e.value)


def test_sources_that_do_not_tile_are_refused():
    full = _simple()
    holed = Holdings(dtype="float64", itemsize=ISZ, shape=(4, 4), held=full.held[:1])  # half
    with pytest.raises(TransferError, match="cover 8 of 16"):
        plan_transfer({"a": holed}, {"a": full}, None, 4, Budget(1 << 30))


def test_cat_needs_names():
    with pytest.raises(TransferError):
        Cat("qkv")
    with pytest.raises(TransferError):
        Cat(())
