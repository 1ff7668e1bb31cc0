"""The read/exchange plan behind ``load`` and ``convert``.

Pure: every rank computes the same plan from the source index and the wanted target boxes.

* **Row grid.** Each tensor is cut along dim 0 into global row bands of at most a quarter
  of the budget (full-width bytes). Stored chunks and target boxes are cut on the same
  grid, so everything one band of rows needs is read, moved and written together.
* **Reads.** A stored chunk's rows in one band are one contiguous byte range of its file.
  With ``exchange`` it is read by exactly one rank — the holder that receives most of it,
  else the least-loaded one — so each needed byte is read once per job. With ``direct``
  every destination reads the rows it needs itself and nothing is exchanged.
* **Parts.** A read's intersection with a target box goes to every holder of that box;
  the reader keeps its own and sends the rest.
* **Waves.** Whole row bands are grouped so that each rank's in-flight bytes (read
  buffers, send and receive buffers, target buffers) stay under the budget (the one
  packer, :func:`~reshard_svc.plan.packing.pack`); each wave is one ``all_to_all``, and
  every target band is complete at the end of its wave.
* **Templates.** Tensors with the same shape, stored boxes and target boxes (the layers
  of a model) share one chunk-relative plan (:mod:`reshard_svc.plan.template`), planned
  once and placed at each tensor's files and offsets; reads and parts are built per wave
  as the executor reaches it. Only distinct layouts are planned; the rest is one pass
  over the chunk lists (and a repeated plan comes from :data:`PLANS`).

The plan speaks :mod:`reshard_svc.plan.items` (:class:`Read`, :class:`Piece`,
:class:`Target`), as every plan the executor runs does.
"""

from __future__ import annotations

import bisect
import logging
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, overload

import numpy as np

from reshard_svc._collector import collector_paused
from reshard_svc.errors import UsageError
from reshard_svc.format.index import CheckpointIndex, Chunk
from reshard_svc.layout import Box
from reshard_svc.plan.budget import Budget
from reshard_svc.plan.cache import PlanCache, SampledKey
from reshard_svc.plan.cost import StorageCost
from reshard_svc.plan.items import Held, Piece, Read, Target
from reshard_svc.plan.packing import pack
from reshard_svc.plan.template import (
    EVERY_HOLDER,
    Template,
    build_template,
    row_step,
    split_rows,
)

__all__ = [
    "PLANS",
    "BandWave",
    "ReadPlan",
    "StorageCost",
    "choose_plan",
    "warn_if_over_budget",
    "plan_reads",
    "row_step",
    "split_rows",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False, kw_only=True)
class _Instance:
    """One tensor's plan: its template, placed at its chunks' files and offsets."""

    tensor: str
    template: Template
    chunks: tuple[Chunk, ...]
    target_base: int  # index of its first target in the plan
    read_base: int  # id of its first read


@dataclass(frozen=True, eq=False)
class BandWave:
    """One ``all_to_all``: whole row bands of some tensors, as (tensor plan, band) items.

    ``reads`` and ``pieces`` are built from the templates on each access (the executor
    takes them once per wave), pieces ordered by (reader, dest, read, box).
    """

    items: tuple[tuple[_Instance, int], ...]
    #: tensors whose last row band is in this wave (for progress)
    tensors_done: int = 0

    @property
    def reads(self) -> tuple[Read, ...]:
        out = []
        for inst, b in self.items:
            band = inst.template.bands[b]
            base = inst.read_base + inst.template.read_offsets[b]
            to = inst.template.rank_of
            for i, r in enumerate(band.reads):
                c = inst.chunks[r.chunk]
                begin = c.begin + r.skip
                out.append(
                    Read(
                        id=base + i,
                        tensor=inst.tensor,
                        box=r.box,
                        reader=to(r.reader),
                        file=c.file,
                        begin=begin,
                        end=begin + r.nbytes,
                        encoding=c.encoding,
                    )
                )
        return tuple(out)

    @property
    def crosses(self) -> bool:
        """Whether any piece goes from one rank to another (every rank then exchanges)."""
        for inst, b in self.items:
            tpl = inst.template
            band = tpl.bands[b]
            for p in band.pieces:
                reader = tpl.rank_of(band.reads[p.read].reader)
                if p.dest == EVERY_HOLDER:
                    if len(tpl.targets[p.target].holders) > 1:
                        return True
                elif p.dest != reader:
                    return True
        return False

    @property
    def relays(self) -> bool:
        """Whether any piece is forwarded by a via (the wave then has a second round on
        every rank)."""
        for inst, b in self.items:
            tpl = inst.template
            band = tpl.bands[b]
            for p in band.pieces:  # relabelling keeps reader != via
                reader = tpl.rank_of(band.reads[p.read].reader)
                if p.via >= 0 and p.via != band.reads[p.read].reader:
                    others = len(tpl.targets[p.target].holders) - tpl.holds(p.target, reader)
                    if others > 1:  # holders besides the reader and the via
                        return True
        return False

    @property
    def tensors(self) -> tuple[str, ...]:
        """Tensors whose last row band is in this wave."""
        return tuple(i.tensor for i, b in self.items if b == len(i.template.bands) - 1)

    @property
    def nbytes(self) -> int:
        """Bytes the wave delivers, over every rank (each holder's copy counted)."""
        total = 0
        for inst, b in self.items:
            tpl = inst.template
            for p in tpl.bands[b].pieces:
                copies = 1 if p.dest != EVERY_HOLDER else len(tpl.targets[p.target].holders)
                total += p.nbytes * copies
        return total

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """Every piece of the wave, for every rank (tests, and plans that need them all)."""
        return self._pieces(None)

    def pieces_for(self, rank: int) -> tuple[Piece, ...]:
        """The pieces ``rank`` sends or receives, in the wave's order: what the executor
        needs on that rank, without expanding anyone else's replicated pieces."""
        return self._pieces(rank)

    def _pieces(self, me: int | None) -> tuple[Piece, ...]:
        keyed = []
        for inst, b in self.items:
            tpl = inst.template
            band = tpl.bands[b]
            base = inst.read_base + tpl.read_offsets[b]
            t0 = inst.target_base
            to = tpl.rank_of
            for p in band.pieces:
                reader = to(band.reads[p.read].reader)
                via = to(p.via) if p.via >= 0 else reader
                if p.dest != EVERY_HOLDER:
                    dests: Iterable[int] = (p.dest,)
                    if me is not None and me != reader and me != p.dest:
                        continue
                elif me is None or via == reader and me == reader:
                    dests = tpl.targets[p.target].holders
                elif me == reader:  # its own copy, and the via's
                    dests = (me, via) if tpl.holds(p.target, me) else (via,)
                elif me == via:  # its copy, and the holders it forwards to
                    dests = [d for d in tpl.targets[p.target].holders if d != reader]
                elif tpl.holds(p.target, me):
                    dests = (me,)
                else:
                    continue
                for d in dests:
                    piece = Piece(
                        read=base + p.read,
                        box=p.box,
                        target=t0 + p.target,
                        dest=d,
                        nbytes=p.nbytes,
                        via=via if p.via >= 0 else -1,
                    )
                    keyed.append(((reader, d, piece.read, p.box), piece))
        keyed.sort(key=lambda kp: kp[0])
        return tuple(p for _, p in keyed)


class _Targets(Sequence[Target]):
    """Every target box of the plan, by index, built on access from the templates."""

    def __init__(self, instances: Sequence[_Instance]) -> None:
        self._inst = instances
        self._bases = [i.target_base for i in instances]
        self._n = sum(len(i.template.targets) for i in instances)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Target: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Target]: ...
    def __getitem__(self, i: int | slice) -> Target | Sequence[Target]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        inst = self._inst[bisect.bisect_right(self._bases, i) - 1]
        held = inst.template.targets[i - inst.target_base]
        return Target(tensor=inst.tensor, box=held.box, holders=held.holders)

    def __iter__(self) -> Iterator[Target]:
        for inst in self._inst:
            for held in inst.template.targets:
                yield Target(tensor=inst.tensor, box=held.box, holders=held.holders)


@dataclass(frozen=True, eq=False, kw_only=True)
class ReadPlan:
    """The whole plan; every rank computes the same one. Frozen once built."""

    targets: Sequence[Target]
    waves: tuple[BandWave, ...]
    world: int
    strategy: str
    instances: tuple[_Instance, ...] = field(default=(), repr=False)
    #: one ``all_to_all`` per wave (a read plan's pieces go between most pairs of ranks)
    point_to_point = False

    @property
    def tensor_count(self) -> int:
        """Tensors with at least one target box."""
        return len(self.instances)

    @property
    def bytes_total(self) -> int:
        return sum(i.template.total for i in self.instances)

    def bytes_read(self) -> list[int]:
        out = np.zeros(self.world, dtype=np.int64)
        for i in self.instances:
            out += i.template.read_bytes
        return [int(x) for x in out]

    def bytes_sent(self) -> list[int]:
        """Bytes each rank sends to other ranks (its reads' parts for other holders)."""
        out = np.zeros(self.world, dtype=np.int64)
        for i in self.instances:
            out += i.template.sent_bytes
        return [int(x) for x in out]

    def bytes_received(self) -> list[int]:
        """Bytes each rank receives from other ranks."""
        out = np.zeros(self.world, dtype=np.int64)
        for i in self.instances:
            out += i.template.recv_bytes
        return [int(x) for x in out]

    def peak_use(self) -> list[int]:
        """Each rank's most bytes in flight in one wave (read, send, receive and target
        buffers): what the memory budget bounds."""
        peak = np.zeros(self.world, dtype=np.int64)
        for wave in self.waves:
            use = np.zeros(self.world, dtype=np.int64)
            for inst, b in wave.items:
                use += inst.template.bands[b].use
            np.maximum(peak, use, out=peak)
        return [int(x) for x in peak]

    def reads_count(self) -> int:
        return sum(i.template.n_reads for i in self.instances)

    def deliveries(self) -> int:
        """Pieces as they land, a replicated piece once per holder: about the reads a
        ``direct`` plan of the same targets would make."""
        return sum(i.template.deliveries for i in self.instances)

    def bytes_exchanged(self) -> int:
        return sum(i.template.moved for i in self.instances)


def warn_if_over_budget(index: CheckpointIndex, names: Iterable[str], budget: Budget) -> None:
    """Say (once per call) when one row of a tensor alone exceeds the budget's band."""
    widest = max(
        (
            (math.prod(index.tensors[n].shape[1:]) * index.tensors[n].itemsize, n)
            for n in names
            if index.tensors[n].shape
        ),
        default=(0, ""),
    )
    if widest[0] > budget.band:
        logger.warning(
            "a memory budget of %d B cannot be met: one row of %r is %d B and a wave moves "
            "at least one row; waves will exceed it (give at least %d B)",
            budget.total,
            widest[1],
            widest[0],
            4 * widest[0],
        )


def plan_reads(
    index: CheckpointIndex,
    wanted: Mapping[str, Sequence[Held]],
    world: int,
    budget: Budget,
    *,
    strategy: str = "exchange",
) -> ReadPlan:
    """Plan reading ``wanted`` (tensor -> its distinct target boxes and their holders).

    Target boxes stay whole; ``convert`` passes boxes already cut with :func:`split_rows`
    on the same grid (:func:`row_step` of ``budget.band``) so each is written when its
    wave ends. Tensors with the same shape, stored chunks and targets share one
    :class:`~reshard_svc.plan.template.Template`, planned once; a plan for the same
    inputs is served from a small cache.
    """
    if strategy not in ("exchange", "direct"):
        raise UsageError(f"strategy must be 'exchange' or 'direct', got {strategy!r}")
    return choose_plan(index, wanted, world, budget, strategy, None)


def choose_plan(
    index: CheckpointIndex,
    wanted: Mapping[str, Sequence[Held]],
    world: int,
    budget: Budget,
    strategy: str,
    cost: StorageCost | None,
) -> ReadPlan:
    """The plan for ``strategy``; ``auto`` plans both and keeps the cheaper under ``cost``.

    Off local files (object stores: every request and byte is paid for) ``auto`` keeps
    exchange's read-once plan whenever ``direct`` would read more bytes. The same inputs
    (checkpoint chunks, target boxes and holders, world, budget, strategy, cost) are
    answered from a cache of the last few plans.
    """
    if strategy not in ("auto", "exchange", "direct"):
        raise UsageError(f"strategy must be auto, exchange or direct, got {strategy!r}")
    # a plan is hundreds of thousands of small acyclic objects, kept: no collection
    # mid-plan, and none walking them as young objects after
    with collector_paused(settle=True):
        sigs = _signatures(index, wanted)
        head = (world, budget, strategy, cost if strategy == "auto" else None)
        # hashed: the tensors and their template keys (each hashed once, by a sample, as
        # sharing templates needs), not every chunk's file and offset; compared: all of it
        digest = (*head, tuple((name, tkey) for name, tkey, _ in sigs))
        return PLANS.get_or_build(
            (*head, sigs), lambda: _choose(index, sigs, world, budget, strategy, cost), digest
        )


def _choose(
    index: CheckpointIndex,
    sigs: tuple[Any, ...],
    world: int,
    budget: Budget,
    strategy: str,
    cost: StorageCost | None,
) -> ReadPlan:
    ids: dict[Any, int] = {}  # template key -> small id: each key hashed once per call
    tids = [ids.setdefault(s[1], len(ids)) for s in sigs]
    if strategy != "auto":
        plan = _plan(index, sigs, tids, world, budget, strategy)
    else:
        model = cost if cost is not None else StorageCost(latency_s=5e-5, bandwidth=3e9)
        exchange = _plan(index, sigs, tids, world, budget, "exchange")
        # direct reads every holder's own copy: at least the bytes delivered; a plan of
        # more reads than MAX_DIRECT_READS is not worth planning (replicas on thousands
        # of ranks: exchange reads once and fans out)
        floor = exchange.bytes_total / model.bandwidth / max(1, world)
        if exchange.deliveries() > MAX_DIRECT_READS or floor >= model.seconds(exchange):
            return exchange
        direct = _plan(index, sigs, tids, world, budget, "direct")
        if not model.local and sum(direct.bytes_read()) > sum(exchange.bytes_read()):
            plan = exchange
        elif model.seconds(direct) < model.seconds(exchange):
            plan = direct
        else:
            plan = exchange
    return plan


def _signatures(index: CheckpointIndex, wanted: Mapping[str, Sequence[Held]]) -> tuple[Any, ...]:
    """Per tensor: (name, template key, where its chunks are stored). The template key is
    (shape, itemsize, stored boxes, non-empty target boxes, their holders); built with
    C-level getters, as it is one pass over every chunk and target box."""
    sigs = []
    for name in sorted(wanted):
        meta = index.tensors[name]
        held = wanted[name]
        boxes = tuple(map(_BOX, held))
        geo = tuple(map(_BOX_SIG, boxes))
        holders = tuple(map(_HOLDERS, held))
        if not set(map(type, holders)) <= {tuple}:
            holders = tuple(tuple(h) for h in holders)
        full = tuple(map(all, map(_SIZES, boxes)))  # no size 0: a box not empty
        if not all(full):  # drop empty boxes
            geo, holders = tuple(compress(geo, full)), tuple(compress(holders, full))
        tkey = SampledKey((meta.shape, meta.itemsize, meta.plan_chunks, geo, holders))
        sigs.append((name, tkey, meta.plan_places))
    return tuple(sigs)


def _plan(
    index: CheckpointIndex,
    sigs: tuple[Any, ...],
    tids: list[int],
    world: int,
    budget: Budget,
    strategy: str,
) -> ReadPlan:
    limit = budget.band
    seen: dict[int, int] = {}
    templates: dict[int, dict[int, Template]] = {}
    instances: list[_Instance] = []
    t_base = r_base = 0
    for (name, tkey, _), tid in zip(sigs, tids):
        if not tkey[3]:
            continue
        variants = templates.get(tid)
        if variants is None:
            variants = templates[tid] = {0: _template(tkey, limit, world, strategy)}
        n = seen[tid] = seen.get(tid, -1) + 1
        nv = min(variants[0].ties, MAX_VARIANTS)
        v = n % nv
        tpl = variants.get(v)
        if tpl is None:
            tpl = variants[0].rotated(v, nv) or _template(tkey, limit, world, strategy, v)
            variants[v] = tpl
        instances.append(
            _Instance(
                tensor=name,
                template=tpl,
                chunks=index.tensors[name].chunks,
                target_base=t_base,
                read_base=r_base,
            )
        )
        t_base += len(tpl.targets)
        r_base += tpl.n_reads
    return ReadPlan(
        targets=_Targets(instances),
        waves=_waves(instances, world, budget),
        world=world,
        strategy=strategy,
        instances=tuple(instances),
    )


#: ``auto`` plans ``direct`` only when it would make at most this many reads (about the
#: pieces as landed, a replicated piece once per holder)
MAX_DIRECT_READS = 5_000_000

#: Templates one shape is planned in at most, its reads rotated over tied readers (tensors
#: sharing it take them in turn): enough to spread replicated tensors' reads, bounded so a
#: box held by 4,096 ranks is not planned 4,096 times.
MAX_VARIANTS = 16

#: The last few read plans, keyed by their whole inputs: the checkpoint's chunks, the
#: target boxes and holders, world, budget, strategy and cost model.
PLANS: PlanCache[ReadPlan] = PlanCache(4)
_BOX, _HOLDERS = operator.attrgetter("box"), operator.attrgetter("holders")
_BOX_SIG = operator.attrgetter("offsets", "sizes")
_SIZES = operator.attrgetter("sizes")


def _template(tkey: Any, limit: int, world: int, strategy: str, variant: int = 0) -> Template:
    shape, itemsize, chunks, geo, holders = tkey
    return build_template(
        [(Box.trusted(c[0], c[1]), c[2], c[3] if len(c) > 3 else 0) for c in chunks],
        [Held(box=Box.trusted(o, s), holders=h) for (o, s), h in zip(geo, holders)],
        shape,
        itemsize,
        limit,
        world,
        strategy,
        variant,
    )


def _waves(instances: Sequence[_Instance], world: int, budget: Budget) -> tuple[BandWave, ...]:
    """Whole row bands, in order, packed into waves under the per-rank byte budget."""
    items = [(inst, b) for inst in instances for b in range(len(inst.template.bands))]
    last = [b == len(inst.template.bands) - 1 for inst, b in items]
    costs = (inst.template.bands[b].use for inst, b in items)
    peaks = (inst.template.bands[b].peak for inst, b in items)
    return tuple(
        BandWave(tuple(items[start:end]), sum(last[start:end]))
        for start, end in pack(costs, world, budget.total, peaks)
    )
