"""Properties of the pure read/exchange planner (``read_plan.plan_reads``), on random
source and target layouts (strided shards and uneven splits included) and budgets.

* every byte of every target box reaches each of its holders exactly once;
* every part comes from bytes its read fetched, at the right file offsets;
* under ``exchange`` each stored byte is read at most once; under ``direct`` nothing moves
  between ranks;
* each wave stays within the per-rank budget, unless it is a single row band that alone
  exceeds it (a row wider than a quarter of the budget).

Each problem has 1-3 tensors of the same shape and layouts, stored in different files at
different offsets: they share one plan template, so these also check that a template is
placed at each tensor's own chunks, and that each tensor is planned as it would be alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard_svc.format.index import CheckpointIndex, Chunk, TensorMeta
from reshard_svc.layout import Box, Layout
from reshard_svc.layout.box import check_tiling
from reshard_svc.plan.budget import Budget
from reshard_svc.plan.items import Held
from reshard_svc.plan.read import ReadPlan, plan_reads, row_step
from tests.unit.test_layout import cases

EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ISZ = 4  # float32


def stored(name: str, shape: tuple[int, ...], layout: Layout, at: int = 64) -> TensorMeta:
    """The tensor as ``save`` stores it: one file per write item, bytes row-major."""
    chunks = []
    for k, item in enumerate(layout.write_items(shape, ISZ)):
        n = item.box.numel * ISZ
        chunks.append(Chunk(box=item.box, file=f"{name}-{k}.safetensors", begin=at, end=at + n))
    return TensorMeta(
        name=name, dtype=torch.float32, shape=shape, layout=layout, chunks=tuple(chunks)
    )


@st.composite
def problems(draw):
    family = draw(st.sampled_from(["shard", "strided", "replicate"]))
    shape, src = draw(cases(family))
    dst = draw(cases_for(shape))
    total = max(1, math.prod(shape) * ISZ)
    budget = draw(st.integers(1, 4 * total + 64))
    strategy = draw(st.sampled_from(["exchange", "direct"]))
    copies = draw(st.integers(1, 3))
    return shape, src, dst, budget, strategy, copies


@st.composite
def cases_for(draw, shape: tuple[int, ...]):
    """A random layout (shard, strided or replicate) for ``shape``."""
    from reshard_svc.layout import Mesh, Replicate, Shard, StridedShard

    mesh = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 2))))
    placements = []
    for _ in mesh:
        kind = draw(st.sampled_from(["R", "S", "SS"])) if shape else "R"
        if kind == "R":
            placements.append(Replicate())
        elif kind == "S":
            placements.append(Shard(draw(st.integers(0, len(shape) - 1))))
        else:
            placements.append(
                StridedShard(draw(st.integers(0, len(shape) - 1)), draw(st.integers(1, 3)))
            )
    return Layout(Mesh(mesh), tuple(placements))


def plan_for(shape, src, dst, budget, strategy, copies=1):
    names = [f"t{i}" for i in range(copies)]
    tensors = {n: stored(n, shape, src, at=64 + 8 * i) for i, n in enumerate(names)}
    index = CheckpointIndex(tensors=tensors, files={})
    boxes = [Held(box=it.box, holders=it.holders) for it in dst.write_items(shape, ISZ)]
    wanted = dict.fromkeys(names, boxes)
    plan = plan_reads(index, wanted, dst.mesh.size, Budget(budget), strategy=strategy)
    return index, plan, wanted


@EXAMPLES
@given(problems())
def test_every_target_byte_reaches_each_holder_once(problem):
    _, plan, wanted = plan_for(*problem)
    want = {
        (n, h.box, r)
        for n, hs in wanted.items()
        for h in hs
        if not h.box.is_empty
        for r in h.holders
    }
    got: dict[tuple[str, Box, int], list[Box]] = {}
    reads = {r.id: r for w in plan.waves for r in w.reads}
    for w in plan.waves:
        for p in w.pieces:
            t = plan.targets[p.target]
            assert t.box.contains(p.box) and p.dest in t.holders
            assert reads[p.read].tensor == t.tensor
            got.setdefault((t.tensor, t.box, p.dest), []).append(p.box)
    assert set(got) == want
    for (_, box, _), pieces in got.items():
        local = [Box(tuple(o - b for o, b in zip(p.offsets, box.offsets)), p.sizes) for p in pieces]
        check_tiling(box.sizes, local, "target box")


@EXAMPLES
@given(problems())
def test_parts_come_from_their_reads_at_the_right_offsets(problem):
    index, plan, _ = plan_for(*problem)
    chunks = {c.file: c for t in index.tensors.values() for c in t.chunks}
    reads = {r.id: r for w in plan.waves for r in w.reads}
    for w in plan.waves:
        wave_reads = {r.id for r in w.reads}
        for p in w.pieces:
            assert p.read in wave_reads, "a part's read is in another wave"
            assert reads[p.read].box.contains(p.box)
            assert p.nbytes == p.box.numel * ISZ
    assert sorted(reads) == list(range(plan.reads_count())), "read ids are 0..n-1"
    for r in reads.values():
        c = chunks[r.file]
        assert r.file.startswith(r.tensor + "-")
        assert c.box.contains(r.box)
        # a read is whole rows of its chunk: one contiguous byte range
        assert r.box.offsets[1:] == c.box.offsets[1:] and r.box.sizes[1:] == c.box.sizes[1:]
        row = math.prod(c.box.sizes[1:]) * ISZ if c.box.ndim else 0
        skip = (r.box.offsets[0] - c.box.offsets[0]) * row if c.box.ndim else 0
        assert r.begin == c.begin + skip and r.nbytes == r.box.numel * ISZ


@EXAMPLES
@given(problems())
def test_exchange_reads_each_byte_once_and_direct_moves_nothing(problem):
    strategy = problem[4]
    _, plan, _ = plan_for(*problem)
    if strategy == "direct":
        assert plan.bytes_exchanged() == 0
        return
    spans = sorted((r.file, r.begin, r.end) for w in plan.waves for r in w.reads)
    for (f1, _, e1), (f2, b2, _) in zip(spans, spans[1:]):
        assert f1 != f2 or e1 <= b2, "a stored byte is read twice"


@EXAMPLES
@given(problems())
def test_waves_stay_within_the_budget(problem):
    shape, budget = problem[0], problem[3]
    _, plan, _ = plan_for(*problem)
    step = row_step(shape, ISZ, Budget(budget).band)
    reads = {r.id: r for w in plan.waves for r in w.reads}
    for w in plan.waves:
        use = [0] * plan.world
        for r in w.reads:
            use[r.reader] += r.nbytes
        for p in w.pieces:
            use[p.dest] += p.nbytes
            sender = p.sender(reads[p.read].reader)  # the reader, or the via relaying it
            if p.dest != sender:
                use[sender] += p.nbytes
        bands = {(r.tensor, r.box.offsets[0] // step if r.box.ndim else 0) for r in w.reads}
        assert max(use) <= budget or len(bands) == 1, (max(use), budget, bands)


@EXAMPLES
@given(problems())
def test_a_shared_template_plans_each_tensor_as_if_alone(problem):
    """Each tensor of a multi-tensor plan reads the same boxes, at its own file offsets,
    and delivers the same parts as a plan of that tensor alone (readers may rotate)."""
    shape, src, dst, budget, strategy, copies = problem
    index, plan, wanted = plan_for(shape, src, dst, budget, strategy, copies)

    def shape_of(p: ReadPlan, name: str) -> set:
        reads = {r.id: r for w in p.waves for r in w.reads if r.tensor == name}
        out: dict[int, set] = {i: set() for i in reads}
        for w in p.waves:
            for part in w.pieces:
                if part.read in reads:
                    out[part.read].add((part.box, part.dest))
        return {(reads[i].file, reads[i].begin, reads[i].box, frozenset(v)) for i, v in out.items()}

    for name, meta in index.tensors.items():
        alone = plan_reads(
            CheckpointIndex(tensors={name: meta}, files={}),
            {name: wanted[name]},
            plan.world,
            Budget(budget),
            strategy=strategy,
        )
        assert shape_of(plan, name) == shape_of(alone, name), name


@EXAMPLES
@given(problems())
def test_each_rank_sends_only_what_it_has_and_sees_its_own_pieces(problem):
    """Replicated stripes relayed in a wave's second round: a reader sends bytes it read;
    a via forwards only a stripe it received in the first round; and each rank's own view
    of the wave (``pieces_for``) is exactly the pieces it sends or lands."""
    _, plan, _ = plan_for(*problem)
    for w in plan.waves:
        reads = {r.id: r for r in w.reads}
        every = w.pieces
        first = {
            (p.read, p.box, p.dest)
            for p in every
            if p.sender(reads[p.read].reader) == reads[p.read].reader
        }
        for p in every:
            reader = reads[p.read].reader
            sender = p.sender(reader)
            holders = plan.targets[p.target].holders
            if sender != reader:  # relayed: the via is a holder that got it first
                assert p.via in holders and (p.read, p.box, p.via) in first
                assert p.dest not in (p.via, reader)
                assert w.relays
        for me in range(plan.world):
            mine = set(w.pieces_for(me))
            assert mine == {p for p in every if me in (p.dest, p.sender(reads[p.read].reader))}


@pytest.mark.parametrize("shape", [(64 * 6, 40), (64, 4096)], ids=["narrow", "wide-rows"])
def test_a_replicated_tensor_is_read_once_and_every_holder_sends_about_one_copy(shape):
    """One tensor stored as 64 FSDP chunks, loaded Replicate on 48 ranks: each stored
    byte read once, readers striped over the holders, and the copies fanned out through
    the holders (a second round) so no rank sends much more than one copy; rows wider
    than a holder's share are cut along dim 1."""
    index = CheckpointIndex(
        tensors={"w": stored("w", shape, Layout.parse("dp=64", "S(0)"))}, files={}
    )
    dst = Layout.parse("tp=48", "R")
    wanted = {"w": [Held(box=it.box, holders=it.holders) for it in dst.write_items(shape, ISZ)]}
    plan = plan_reads(index, wanted, 48, Budget(1 << 30), strategy="exchange")
    total = math.prod(shape) * ISZ
    assert sum(plan.bytes_read()) == total
    sent = plan.bytes_sent()
    assert sum(plan.bytes_received()) == total * 47
    assert max(sent) <= 1.10 * (sum(sent) / len(sent)), sent
    assert max(sent) < 1.10 * total
    assert any(w.relays for w in plan.waves)


def test_tied_reads_spread_over_tensors_that_share_a_template():
    """Replicated targets: every holder receives a read equally, so tensors that share a
    template take turns instead of all being read by the same rank."""
    src, dst = Layout.parse("tp=2", "R"), Layout.parse("dp=4", "R")
    tensors = {f"n{i}": stored(f"n{i}", (64,), src) for i in range(8)}
    index = CheckpointIndex(tensors=tensors, files={})
    wanted = {
        n: [Held(box=it.box, holders=it.holders) for it in dst.write_items((64,), ISZ)]
        for n in tensors
    }
    plan = plan_reads(index, wanted, 4, Budget(1 << 20), strategy="exchange")
    assert plan.bytes_read() == [2 * 64 * ISZ] * 4
    assert max(plan.bytes_sent()) == min(plan.bytes_sent()) == 2 * 3 * 64 * ISZ


def test_repeated_plans_hit_the_cache():
    shape, src, dst = (64, 32), Layout.parse("tp=4", "S(0)"), Layout.parse("tp=2", "S(1)")
    a = plan_for(shape, src, dst, 1 << 16, "exchange", 3)[1]
    assert plan_for(shape, src, dst, 1 << 16, "exchange", 3)[1] is a
    assert plan_for(shape, src, dst, 1 << 15, "exchange", 3)[1] is not a
    # the same chunks at other byte offsets are another plan
    index, _, wanted = plan_for(shape, src, dst, 1 << 16, "exchange", 3)
    moved = {
        n: TensorMeta(
            name=m.name,
            dtype=m.dtype,
            shape=m.shape,
            layout=m.layout,
            chunks=tuple(
                Chunk(box=c.box, file=c.file, begin=c.begin + 8, end=c.end + 8) for c in m.chunks
            ),
        )
        for n, m in index.tensors.items()
    }
    b = plan_reads(CheckpointIndex(tensors=moved, files={}), wanted, 2, Budget(1 << 16))
    assert b is not a and {r.begin for w in b.waves for r in w.reads} != {
        r.begin for w in a.waves for r in w.reads
    }


def _replicated_problem():
    shape = (4096, 1024)  # 16 MiB: bytes, not requests, decide
    src = Layout.parse("tp=4", "S(0)")
    dst = Layout.parse("dp=2", "R")
    meta = stored("t", shape, src)
    index = CheckpointIndex(tensors={"t": meta}, files={})
    wanted = {"t": [Held(box=it.box, holders=it.holders) for it in dst.write_items(shape, ISZ)]}
    return index, wanted


def test_auto_keeps_read_once_off_local_files_and_picks_direct_on_a_page_cache():
    from reshard_svc.plan.read import StorageCost, choose_plan

    index, wanted = _replicated_problem()
    total = 4096 * 1024 * ISZ
    remote = StorageCost(latency_s=3e-2, bandwidth=5e8, local=False)
    plan = choose_plan(index, wanted, 2, Budget(1 << 20), "auto", remote)
    assert plan.strategy == "exchange" and sum(plan.bytes_read()) == total
    # Even a remote store that claims to be fast keeps read-once: requests cost money.
    fast_remote = StorageCost(latency_s=1e-6, bandwidth=1e12, local=False)
    assert (
        choose_plan(index, wanted, 2, Budget(1 << 20), "auto", fast_remote).strategy == "exchange"
    )
    local = StorageCost(latency_s=5e-5, bandwidth=3e9, local=True)
    plan = choose_plan(index, wanted, 2, Budget(1 << 20), "auto", local)
    assert plan.strategy == "direct" and plan.bytes_exchanged() == 0
    # a slow exchange makes direct win; a slow local disk makes exchange win
    slow_disk = StorageCost(latency_s=5e-5, bandwidth=1e6, exchange_bandwidth=1e12, local=True)
    assert choose_plan(index, wanted, 2, Budget(1 << 20), "auto", slow_disk).strategy == "exchange"


def test_auto_does_not_plan_direct_for_replicas_on_thousands_of_ranks(monkeypatch):
    """A direct plan reads every holder's copy itself: past MAX_DIRECT_READS (a norm on
    4,096 ranks of a 1T model) auto keeps exchange without planning direct at all."""
    from reshard_svc.plan import read as read_plan

    index, wanted = _replicated_problem()
    local = read_plan.StorageCost(latency_s=5e-5, bandwidth=3e9, local=True)
    read_plan.PLANS.clear()
    assert (
        read_plan.choose_plan(index, wanted, 2, Budget(1 << 20), "auto", local).strategy == "direct"
    )
    planned = []
    real = read_plan._plan
    monkeypatch.setattr(read_plan, "_plan", lambda *a: planned.append(a[-1]) or real(*a))
    monkeypatch.setattr(read_plan, "MAX_DIRECT_READS", 1)
    read_plan.PLANS.clear()
    assert (
        read_plan.choose_plan(index, wanted, 2, Budget(1 << 20), "auto", local).strategy
        == "exchange"
    )
    assert planned == ["exchange"]


def test_cost_settings_come_from_the_environment(monkeypatch):
    import pytest

    from reshard_svc.errors import UsageError
    from reshard_svc.plan.read import StorageCost
    from reshard_svc.storage import open_storage

    storage = open_storage("memory://cost-settings")
    assert StorageCost.of(storage).local is False
    monkeypatch.setenv("RESHARD_STORAGE_BANDWIDTH", "2e9")
    monkeypatch.setenv("RESHARD_EXCHANGE_BANDWIDTH", "1e10")
    cost = StorageCost.of(storage)
    assert cost.bandwidth == 2e9 and cost.exchange_bandwidth == 1e10
    assert cost.latency_s == storage.latency_s
    monkeypatch.setenv("RESHARD_STORAGE_LATENCY_S", "fast")
    with pytest.raises(UsageError, match="RESHARD_STORAGE_LATENCY_S"):
        StorageCost.of(storage)


def test_the_plan_cache_hashes_a_key_once_and_matches_equal_keys():
    from reshard_svc.plan.cache import PlanCache

    class Counted(tuple):
        hashes = 0

        def __hash__(self):
            Counted.hashes += 1
            return tuple.__hash__(self)

    cache: PlanCache[str] = PlanCache(2)
    key = Counted((1, (2, 3)))
    assert cache.get_or_build(key, lambda: "built") == "built"
    assert Counted.hashes == 1  # one hash for the lookup and the store
    assert cache.get_or_build(Counted((1, (2, 3))), lambda: "again") == "built"  # equal, not same
    assert cache.get_or_build((1, (2, 4)), lambda: "other") == "other"
    # a digest hashed in the key's place: keys still compared whole
    assert cache.get_or_build((1, (2, 5)), lambda: "digested", digest=1) == "digested"
    assert cache.get_or_build((1, (2, 5)), lambda: "again", digest=1) == "digested"
    assert cache.get_or_build((1, (2, 6)), lambda: "same digest", digest=1) == "same digest"


def test_a_sampled_key_is_hashed_by_a_sample_and_compared_whole():
    from reshard_svc.plan.cache import SampledKey

    chunks = tuple((i, i + 1) for i in range(100))
    other = chunks[:37] + ((37, 99),) + chunks[38:]  # differs where no sample looks
    a, b, c = SampledKey((4, chunks)), SampledKey((4, tuple(chunks))), SampledKey((4, other))
    assert a == b and hash(a) == hash(b)
    assert hash(a) == hash(c) and a != c  # the same sample: told apart by comparing
    assert {a: 1, c: 2}[b] == 1 and {a: 1, c: 2}[SampledKey((4, other))] == 2
    assert a != (4, chunks) and SampledKey((4, chunks[:-1])) != a  # only its own kind


def _reference_reader(rparts, itemsize, load, turn, groups, heaps, unions=None):
    """The reader rule as it was before the planner took it over arrays: the holders'
    received bytes in a dict, then :func:`least_loaded` (the heap path is unchanged)."""
    from reshard_svc.layout.balance import least_loaded
    from reshard_svc.plan import readers

    _, _, dests = rparts[0]
    if len(dests) > 1 and all(d is dests or d == dests for _, _, d in rparts[1:]):
        return readers.reader_before_arrays(rparts, itemsize, load, turn, groups, heaps)
    recv: dict[int, int] = {}
    for inter, _, ds in rparts:
        for h in ds:
            recv[h] = recv.get(h, 0) + inter.numel * itemsize
    reader = least_loaded(list(recv), load, prefer=recv, turn=turn)
    return reader, sum(1 for v in recv.values() if v == recv[reader])


def _plan_shape(plan: ReadPlan) -> list:
    out = []
    for inst in plan.instances:
        for band in inst.template.bands:
            out.append((band.reads, band.pieces, band.use.tolist()))
    return [
        out,
        plan.bytes_read(),
        plan.bytes_sent(),
        [[(i.tensor, b) for i, b in w.items] for w in plan.waves],
    ]


@st.composite
def world_sharded_to_replicated(draw):
    """A source sharded over a whole world (FSDP2's default), loaded by a mesh whose
    targets are replicated on one dim and split by rows or columns on the other."""
    from reshard_svc.layout import Mesh, Replicate, Shard

    world = draw(st.integers(2, 16))
    shape = (draw(st.integers(1, 40)), draw(st.integers(1, 12)))
    src = Layout(Mesh((world,)), (Shard(0),))
    mesh = (draw(st.integers(1, 5)), draw(st.integers(1, 4)))
    split = draw(st.sampled_from([Shard(0), Shard(1), Replicate()]))
    dst = Layout(Mesh(mesh), (Replicate(), split))
    budget = draw(st.integers(1, 4 * math.prod(shape) * ISZ + 64))
    return shape, src, dst, budget, draw(st.sampled_from(["exchange", "direct"])), 3


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(problems(), world_sharded_to_replicated()))
def test_the_array_reader_plans_exactly_what_the_dict_reader_planned(problem):
    """The reader over arrays (every rank's received bytes and load at once) chooses what
    least_loaded over a dict of holders chose: whole plans are equal, random layouts and
    world-sharded sources into replicated targets alike."""
    from reshard_svc.plan import readers

    def before(mp):
        mp.setattr(readers, "reader_before_arrays", readers.choose_reader, raising=False)
        mp.setattr(readers, "choose_reader", _reference_reader)

    now, then = _planned_now_and_with(problem, before, _plan_shape)
    assert now == then


def _planned_now_and_with(problem, patch, shape):
    """``shape`` of the plan for ``problem`` as the planner makes it, and as it makes it
    with ``patch(monkeypatch)`` applied (each from scratch: the plan cache cleared)."""
    from reshard_svc.plan.read import PLANS

    PLANS.clear()
    now = shape(plan_for(*problem)[1])
    with pytest.MonkeyPatch.context() as mp:
        patch(mp)
        PLANS.clear()
        then = shape(plan_for(*problem)[1])
    PLANS.clear()
    return now, then


@settings(max_examples=300, deadline=None)
@given(
    world=st.integers(2, 64),
    parts=st.lists(
        st.tuples(st.integers(0, 50), st.lists(st.integers(0, 63), min_size=1, max_size=12)),
        min_size=2,
        max_size=8,
    ),
    loads=st.lists(st.integers(0, 3), min_size=64, max_size=64),
    turn=st.integers(0, 20),
)
def test_the_array_reader_chooses_as_least_loaded_does(world, parts, loads, turn):
    """Any read's parts (targets with their holder sets, sizes, empty ones too), any load
    and turn: the same reader and the same count of equally good ones."""
    import numpy as np

    from reshard_svc.plan import readers

    rparts = []
    for t, (n, holders) in enumerate(parts):
        ds = tuple(sorted({h % world for h in holders}))
        rparts.append((Box.trusted((0,), (n,)), t, ds))
    if all(d == rparts[0][2] for _, _, d in rparts) and len(rparts[0][2]) > 1:
        rparts[0] = (rparts[0][0], rparts[0][1], (rparts[0][2][0],))  # not the heap's case
    load = np.asarray(loads[:world], dtype=np.int64)
    got = readers.choose_reader(rparts, 2, load, turn, {}, {})
    from reshard_svc.layout.balance import least_loaded

    recv: dict[int, int] = {}
    for inter, _, ds in rparts:
        for h in ds:
            recv[h] = recv.get(h, 0) + inter.numel * 2
    reader = least_loaded(list(recv), load, prefer=recv, turn=turn)
    assert got == (reader, sum(1 for v in recv.values() if v == recv[reader]))


def _whole_plan(plan: ReadPlan) -> list:
    """Everything a plan gives the executor: the bands, the totals, and per wave its reads
    and pieces with every rank relabelled (a rotated variant's included)."""
    waves = [(w.reads, w.pieces, w.crosses, w.relays, w.nbytes) for w in plan.waves]
    return [_plan_shape(plan), waves]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(problems(), world_sharded_to_replicated()))
def test_the_planners_shortcuts_plan_exactly_what_the_general_paths_planned(problem):
    """The planner's shortcuts (overlaps looked up on the targets' interval grid, the
    reader of disjoint replicated holder sets from their merged holders, waves packed
    under the bound of their bands' peaks) against the general paths they skip (the
    interval join, the reader over arrays of every rank, every rank checked per band):
    whole plans equal, random layouts and world-sharded sources into replicated targets
    alike."""
    from reshard_svc.layout import box
    from reshard_svc.plan import packing, read, readers

    pack = packing.pack

    def general(mp):
        mp.setattr(box, "_on_a_grid", lambda *a: False)
        mp.setattr(readers, "disjoint_reader", lambda *a: None)
        mp.setattr(
            read, "pack", lambda costs, world, budget, peaks=None: pack(costs, world, budget)
        )

    now, then = _planned_now_and_with(problem, general, _whole_plan)
    assert now == then


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.lists(st.integers(0, 50), min_size=3, max_size=3), max_size=20),
    budget=st.integers(0, 120),
)
def test_packing_under_the_bound_of_peaks_groups_as_checking_every_rank_does(costs, budget):
    import numpy as np

    from reshard_svc.plan.packing import pack

    arrays = [np.asarray(c, dtype=np.int64) for c in costs]
    peaks = [max(c) for c in costs]
    assert list(pack(arrays, 3, budget, peaks)) == list(pack(arrays, 3, budget))
    # the reference: a group closes before the item that takes any rank over the budget
    groups, start, use = [], 0, [0, 0, 0]
    for i, c in enumerate(costs):
        if i > start and any(u + x > budget for u, x in zip(use, c)):
            groups.append((start, i))
            start, use = i, [0, 0, 0]
        use = [u + x for u, x in zip(use, c)]
    if costs:
        groups.append((start, len(costs)))
    assert list(pack(arrays, 3, budget, peaks)) == groups
