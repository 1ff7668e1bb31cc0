"""One tensor's read/exchange plan, relative to its chunk list: a *template*.

A DTensor checkpoint repeats itself: the 126 layers of a Llama-405B have the same seven
(shape, source layout, target layout) triples, so their plans differ only in which file
and byte offset each stored chunk sits at. :func:`build_template` plans one tensor in
chunk-relative terms (chunk index and byte skip instead of file and offset, target index
within the tensor); :mod:`reshard_svc.plan.read` plans each distinct template once and
instantiates it per tensor. The rules are those of the module docstring of
:mod:`reshard_svc.plan.read` (row bands, one reader per stored byte under ``exchange``).

Readers are chosen by the one rule every planner uses
(:func:`~reshard_svc.layout.balance.least_loaded`), without any state from other tensors:
the holder that receives most of a read, then the one that has read least within this
tensor, then a rotation by ``variant``. Tensors that share a template but whose reads have
ties (replicated targets) take successive variants, so their reads spread over the tied
ranks. A template's pieces are :class:`~reshard_svc.plan.items.Piece` with read and target
indices relative to the band and the tensor; :mod:`reshard_svc.plan.read` offsets them.

A part of a read that every holder of a replicated target box receives is one piece with
``dest`` :data:`EVERY_HOLDER`, never one per holder: a norm replicated on 4,096 ranks
costs its stored chunks, not chunks × holders. Readers of such a box are striped over its
holders (the least loaded first), so each holder reads about its share and sends about
one copy. Each rank expands only its own pieces (:meth:`Template.holds`).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reshard_svc.layout import Box, overlaps
from reshard_svc.layout.balance import least_loaded
from reshard_svc.plan.items import Held, Piece

__all__ = [
    "EVERY_HOLDER",
    "ChunkRead",
    "TBand",
    "Template",
    "build_template",
    "row_step",
    "split_rows",
]


#: a template piece's ``dest`` when every holder of its target receives it
EVERY_HOLDER = -1


def row_step(shape: Sequence[int], itemsize: int, limit: int) -> int:
    """Rows per global band: as many full-width rows as fit in ``limit`` bytes (>= 1)."""
    if not shape:
        return 1
    row = max(1, math.prod(shape[1:]) * itemsize)
    return max(1, limit // row)


def split_rows(box: Box, step: int) -> list[Box]:
    """``box`` cut on the global row grid of ``step`` rows (0-dim boxes stay whole)."""
    if box.ndim == 0 or box.is_empty:
        return [box]
    lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
    cuts = [lo, *range((lo // step + 1) * step, hi, step), hi]
    rest_o, rest_s = box.offsets[1:], box.sizes[1:]
    return [Box.trusted((a, *rest_o), (b - a, *rest_s)) for a, b in zip(cuts, cuts[1:])]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkRead:
    """A ranged read of rows ``box`` of chunk ``chunk`` (an index into the tensor's chunk
    list): ``skip`` bytes past the chunk's begin, ``nbytes`` long, by rank ``reader``."""

    chunk: int
    skip: int
    nbytes: int
    box: Box
    reader: int


@dataclass(frozen=True, eq=False)
class TBand:
    """Everything one global row band of the tensor needs; ``use`` is each rank's bytes in
    flight for it (read buffers, send buffers, receive or target buffers)."""

    reads: tuple[ChunkRead, ...]
    pieces: tuple[Piece, ...]  # read: index into reads; target: index into the template's
    use: np.ndarray
    peak: int  # use's largest entry (the same on a rotated variant)


@dataclass(frozen=True, eq=False, kw_only=True)
class Template:
    targets: tuple[Held, ...]
    bands: tuple[TBand, ...]
    #: the most equally good readers any read had (instances rotate through that many)
    ties: int
    read_bytes: np.ndarray  # per rank
    sent_bytes: np.ndarray  # per rank, to other ranks
    recv_bytes: np.ndarray  # per rank, from other ranks
    #: reads before each band (a read's id within the tensor is offset + index)
    read_offsets: tuple[int, ...]
    n_reads: int
    moved: int  # bytes that cross between ranks
    total: int  # bytes delivered
    #: per target: its holders as a set when it has more than one (else None)
    holder_sets: tuple[frozenset[int] | None, ...] = ()
    #: a rotated variant's relabelling of the shared bands' readers and vias (rank ->
    #: rank), or None: the bands as planned (:meth:`rank_of`)
    to: np.ndarray | None = None
    #: pieces as landed: a replicated piece once per holder (what ``direct`` would read)
    deliveries: int = 0

    def rank_of(self, rank: int) -> int:
        """A reader or via of the bands, as this variant has it."""
        return int(self.to[rank]) if self.to is not None and rank >= 0 else rank

    def rotated(self, variant: int, variants: int) -> Template | None:
        """This plan with each replicated holder set's ranks shifted by ``variant`` of
        ``variants`` equal steps (readers and vias move with them), or None when a shift
        would move a box's only holder (holder sets that overlap or share a rank with a
        single-holder box): another tensor's equally good plan, without planning it."""
        groups = self._rotating
        if groups is None:
            return None
        perm = np.arange(len(self.read_bytes), dtype=np.int64)
        for ranks in groups:
            perm[ranks] = np.roll(ranks, -(variant * len(ranks) // variants))

        def moved(a: np.ndarray) -> np.ndarray:
            out = np.empty_like(a)
            out[perm] = a
            return out

        bands = tuple(TBand(b.reads, b.pieces, moved(b.use), b.peak) for b in self.bands)
        return Template(
            targets=self.targets,
            bands=bands,
            ties=self.ties,
            read_bytes=moved(self.read_bytes),
            sent_bytes=moved(self.sent_bytes),
            recv_bytes=moved(self.recv_bytes),
            read_offsets=self.read_offsets,
            n_reads=self.n_reads,
            moved=self.moved,
            total=self.total,
            holder_sets=self.holder_sets,
            to=_frozen(perm),
            deliveries=self.deliveries,
        )

    @functools.cached_property
    def _rotating(self) -> list[np.ndarray] | None:
        """The replicated holder sets a rotation shifts (sorted ranks), or None when no
        rotation can be made (see :meth:`rotated`): the same for every variant."""
        seen: set[frozenset[int]] = set()
        multi: set[int] = set()
        singles: set[int] = set()
        groups = []
        for held, hs in zip(self.targets, self.holder_sets):
            if hs is None:
                singles.add(held.holders[0])
            elif hs not in seen:
                if not multi.isdisjoint(hs):
                    return None
                seen.add(hs)
                multi |= hs
                groups.append(np.asarray(sorted(hs), dtype=np.int64))
        if not multi or not multi.isdisjoint(singles):
            return None  # ties among single holders: their readers rotate by planning
        return groups

    def holds(self, target: int, rank: int) -> bool:
        """Whether ``rank`` holds target ``target`` (of this template)."""
        hs = self.holder_sets[target]
        return rank in hs if hs is not None else self.targets[target].holders[0] == rank


ChunkSig = tuple[Box, str, int]  # box, encoding, stored length


def build_template(
    chunks: Sequence[ChunkSig],
    targets: Sequence[Held],
    shape: Sequence[int],
    itemsize: int,
    limit: int,
    world: int,
    strategy: str,
    variant: int = 0,
) -> Template:
    """Plan one tensor: ``chunks`` as stored, ``targets`` (non-empty boxes, holders)."""
    step = row_step(shape, itemsize, limit)
    by_band: dict[int, list[tuple[int, Box, int]]] = {}
    for ci, ti, box in overlaps([c[0] for c in chunks], [t.box for t in targets]):
        if chunks[ci][1] != "raw":  # read whole, in one band of its own
            by_band.setdefault(-1, []).append((ci, box, ti))
            continue
        if not box.sizes:
            by_band.setdefault(0, []).append((ci, box, ti))
            continue
        lo = box.offsets[0]
        key = lo // step
        if (lo + box.sizes[0] - 1) // step == key:  # within one band: no cut
            by_band.setdefault(key, []).append((ci, box, ti))
            continue
        for piece in split_rows(box, step):
            by_band.setdefault(piece.offsets[0] // step, []).append((ci, piece, ti))
    load = np.zeros(world, dtype=np.int64)  # bytes each rank reads, within this tensor
    relay = _Relay(variant)
    bands, ties = [], 1
    for key in sorted(by_band):
        band, tied = _plan_band(by_band[key], chunks, targets, itemsize, strategy, load, relay)
        bands.append(band)
        ties = max(ties, tied)
    return _summarize(tuple(targets), tuple(bands), ties, world)


def _plan_band(
    pieces: list[tuple[int, Box, int]],
    chunks: Sequence[ChunkSig],
    targets: Sequence[Held],
    itemsize: int,
    strategy: str,
    load: np.ndarray,
    relay: _Relay,
) -> tuple[TBand, int]:
    """The reads and parts of one row band (``pieces``: chunk, region, target), and the
    most equally good readers any of its reads had."""
    per_chunk: dict[int, list[tuple[Box, int]]] = {}
    for ci, piece, t in pieces:
        per_chunk.setdefault(ci, []).append((piece, t))
    reads: list[ChunkRead] = []
    parts: list[Piece] = []
    acc: dict[int, int] = {}  # rank -> bytes in flight (summed into ``use`` at the end)
    ties = 1
    groups, variant = relay.groups, relay.variant
    landed: dict[int, int] = {}  # replicated target -> bytes each holder lands in this band
    for ci in sorted(per_chunk):
        box, encoding, length = chunks[ci]
        for read_box, rparts in _read_boxes(box, encoding, per_chunk[ci], strategy, targets):
            if encoding != "raw":
                skip, nb = 0, length
            else:
                skip, nb = _byte_offset(box, read_box, itemsize), read_box.numel * itemsize
            reader, tied = _reader(
                rparts, itemsize, load, variant, groups, relay.heaps, relay.unions
            )
            ties = max(ties, tied)
            load[reader] += nb
            sends = nb  # the reader's read buffer, then its send buffers
            ri = len(reads)
            reads.append(ChunkRead(chunk=ci, skip=skip, nbytes=nb, box=read_box, reader=reader))
            for inter, t, dests in rparts:
                n = inter.numel * itemsize
                if len(dests) == 1:
                    d = dests[0]
                    parts.append(Piece(read=ri, box=inter, target=t, dest=d, nbytes=n))
                    acc[d] = acc.get(d, 0) + n  # receive buffer or target buffer
                    if d != reader:
                        sends += n  # packed send buffer
                    continue
                members = _group(groups, t, dests)[1]
                others = len(dests) - (reader in members)  # holders but the reader
                landed[t] = landed.get(t, 0) + n
                for stripe, sn, via in relay.stripes(inter, n, t, targets, itemsize):
                    parts.append(
                        Piece(read=ri, box=stripe, target=t, dest=EVERY_HOLDER, nbytes=sn, via=via)
                    )
                    if via == reader:
                        sends += sn * others  # sent to every other holder
                    else:  # sent once to the via, which forwards it to the rest
                        sends += sn
                        acc[via] = acc.get(via, 0) + sn * (others - 1)
            acc[reader] = acc.get(reader, 0) + sends
    use = np.zeros(len(load), dtype=np.int64)
    if acc:
        use[np.fromiter(acc, dtype=np.int64, count=len(acc))] = np.fromiter(
            acc.values(), dtype=np.int64, count=len(acc)
        )
    for t, n in landed.items():
        use[groups[t][0]] += n  # receive or target buffers on every holder
    return TBand(tuple(reads), tuple(parts), use, int(use.max(initial=0))), ties


class _Relay:
    """Who forwards each stripe of a replicated box (one template's state): a box held by
    ``n`` ranks is cut by rows into ``n`` stripes of about ``1/n`` of its bytes, in the
    order its parts are read, and holder ``i`` (counted from ``variant``) forwards stripe
    ``i``: so each sends about one copy of the box in all, an all-gather after the reads,
    not one reader sending ``n`` copies."""

    def __init__(self, variant: int) -> None:
        self.variant = variant
        #: target -> its holders (sorted array, set), built once
        self.groups: dict[int, tuple[np.ndarray, frozenset[int]]] = {}
        #: target -> a heap of its holders' (read load, rotated rank, rank) for readers
        self.heaps: dict[int, list[tuple[int, int, int]]] = {}
        #: targets of one read -> their holders merged, sorted (None: the sets meet)
        self.unions: dict[tuple[int, ...], np.ndarray | None] = {}
        self.done: dict[int, int] = {}  # target -> its bytes given a via so far
        self.shares: dict[int, tuple[list[int], float]] = {}  # target -> holders, 1/n bytes

    def stripes(
        self, box: Box, nbytes: int, t: int, targets: Sequence[Held], itemsize: int
    ) -> list[tuple[Box, int, int]]:
        """``box`` (``nbytes``, a part of replicated target ``t``) as (stripe, bytes, via)."""
        got = self.shares.get(t)
        if got is None:
            ranks = self.groups[t][0].tolist()
            got = self.shares[t] = (ranks, max(1, targets[t].box.numel * itemsize) / len(ranks))
        ranks, share = got
        n, turn = len(ranks), self.variant
        at = self.done.get(t, 0)
        self.done[t] = at + nbytes
        first, last = int(at // share), int((at + max(0, nbytes - 1)) // share)
        if first == last or box.ndim == 0:
            return [(box, nbytes, ranks[(min(n - 1, int((at + nbytes / 2) // share)) + turn) % n])]
        # cut where the holders' stripes end, in units of dim 1 (rows of a 1-D box): a
        # stripe is a few boxes (the end of a row, whole rows, the start of a row)
        sizes = box.sizes
        rows = sizes[0]
        cols = sizes[1] if len(sizes) > 1 else 1
        units = rows * cols
        unit = nbytes / units
        cuts = sorted(
            {
                0,
                units,
                *(
                    min(units, max(0, round((j * share - at) / unit)))
                    for j in range(first + 1, last + 1)
                ),
            }
        )
        numel = box.numel
        out: list[tuple[Box, int, int]] = []
        for a, b in zip(cuts, cuts[1:]):
            v = ranks[(min(n - 1, int((at + (a + b) / 2 * unit) // share)) + turn) % n]
            for piece in _unit_boxes(box, cols, a, b):
                out.append((piece, piece.numel * nbytes // numel, v))
        return out


def _unit_boxes(box: Box, cols: int, a: int, b: int) -> list[Box]:
    """Units ``[a, b)`` of ``box`` (row-major over dims 0 and 1) as at most three boxes."""
    lo = box.offsets[0]
    ra, ca = divmod(a, cols)
    rb, cb = divmod(b, cols)
    if box.ndim == 1:
        return [Box.trusted((lo + ra,), (rb - ra,))]  # one unit per row: whole rows
    o1 = box.offsets[1]
    rest_o, rest_s = box.offsets[2:], box.sizes[2:]
    if ra == rb:
        return [Box.trusted((lo + ra, o1 + ca, *rest_o), (1, cb - ca, *rest_s))]
    out = []
    if ca:
        out.append(Box.trusted((lo + ra, o1 + ca, *rest_o), (1, cols - ca, *rest_s)))
        ra += 1
    if rb > ra:
        out.append(Box.trusted((lo + ra, o1, *rest_o), (rb - ra, cols, *rest_s)))
    if cb:
        out.append(Box.trusted((lo + rb, o1, *rest_o), (1, cb, *rest_s)))
    return out


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _group(
    groups: dict[int, tuple[np.ndarray, frozenset[int]]], target: int, holders: tuple[int, ...]
) -> tuple[np.ndarray, frozenset[int]]:
    got = groups.get(target)
    if got is None:
        got = groups[target] = (np.asarray(sorted(holders), dtype=np.int64), frozenset(holders))
    return got


def _reader(
    rparts: list[tuple[Box, int, tuple[int, ...]]],
    itemsize: int,
    load: np.ndarray,
    turn: int,
    groups: dict[int, tuple[np.ndarray, frozenset[int]]],
    heaps: dict[int, list[tuple[int, int, int]]],
    unions: dict[tuple[int, ...], np.ndarray | None] | None = None,
) -> tuple[int, int]:
    """The rank that does one read (:func:`least_loaded`: the holder receiving most of it,
    then the least loaded, rotated by ``turn``) and how many were equally good."""
    _, t, dests = rparts[0]
    if len(dests) > 1 and all(d is dests or d == dests for _, _, d in rparts[1:]):
        # every holder receives all of it: the least loaded holder, from a heap of the
        # group's (load, rank rotated by turn), its stale entries refreshed as they surface
        heap = heaps.get(t)
        if heap is None:
            cand = _group(groups, t, dests)[0].tolist()
            n = len(cand)
            heap = heaps[t] = [(int(load[r]), (i - turn) % n, r) for i, r in enumerate(cand)]
            heapq.heapify(heap)
        while True:
            had, key, r = heap[0]
            now = int(load[r])
            if now == had:
                return r, len(dests)
            heapq.heapreplace(heap, (now, key, r))
    if all(len(ds) == 1 for _, _, ds in rparts):  # a few single destinations
        if all(ds == dests for _, _, ds in rparts):
            return dests[0], 1  # all of it to one rank: that rank reads it
        recv: dict[int, int] = {}
        for inter, _, ds in rparts:
            recv[ds[0]] = recv.get(ds[0], 0) + inter.numel * itemsize
        reader = least_loaded(list(recv), load, prefer=recv, turn=turn)  # type: ignore[arg-type]
        return reader, sum(1 for v in recv.values() if v == recv[reader])
    # several replicated targets' parts (thousands of holders): least_loaded over arrays
    if unions is not None and all(len(ds) > 1 for _, _, ds in rparts):
        got = _disjoint_reader(rparts, itemsize, load, turn, groups, unions)
        if got is not None:
            return got
    bytes_to = np.zeros(len(load), dtype=np.int64)
    holds = np.zeros(len(load), dtype=bool)
    for inter, t, ds in rparts:
        idx = _group(groups, t, ds)[0] if len(ds) > 1 else np.asarray(ds, dtype=np.int64)
        bytes_to[idx] += inter.numel * itemsize
        holds[idx] = True
    cand = np.flatnonzero(holds)  # sorted, as least_loaded's ties are
    most = cand[bytes_to[cand] == bytes_to[cand].max()]  # the holders receiving most of it
    tied = most[load[most] == load[most].min()]  # then the least loaded
    return int(tied[turn % len(tied)]), len(most)


def _disjoint_reader(
    rparts: list[tuple[Box, int, tuple[int, ...]]],
    itemsize: int,
    load: np.ndarray,
    turn: int,
    groups: dict[int, tuple[np.ndarray, frozenset[int]]],
    unions: dict[tuple[int, ...], np.ndarray | None],
) -> tuple[int, int] | None:
    """:func:`_reader`'s array rule where the parts' holder sets are disjoint (a row of
    column-split replicated targets: each rank receives its own target's part, so the
    ranks receiving most are the holders of the largest parts), without an array of every
    rank; None where the sets meet. ``unions`` keeps, per tuple of targets, their holders
    merged and sorted (or None: they meet)."""
    sizes = [inter.numel * itemsize for inter, _, _ in rparts]
    every = tuple(t for _, t, _ in rparts)
    if every not in unions:
        merged = np.concatenate([_group(groups, t, ds)[0] for _, t, ds in rparts])
        merged.sort()
        unions[every] = merged if bool((merged[1:] != merged[:-1]).all()) else None
    if unions[every] is None:
        return None
    top = max(sizes)
    key = tuple(t for t, n in zip(every, sizes) if n == top)
    most = unions.get(key) if key != every else unions[every]
    if most is None:
        most = np.concatenate([groups[t][0] for t in key])
        most.sort()
        unions[key] = most
    low = load[most]
    tied = most[low == low.min()]  # then the least loaded
    return int(tied[turn % len(tied)]), len(most)


def _summarize(
    targets: tuple[Held, ...], bands: tuple[TBand, ...], ties: int, world: int
) -> Template:
    # summed in lists (a numpy element's += costs more than the sum), arrays at the end
    read_bytes = [0] * world
    sent_bytes = [0] * world
    recv_bytes = [0] * world
    sets = tuple(frozenset(t.holders) if len(t.holders) > 1 else None for t in targets)
    landed: dict[int, int] = {}  # replicated target -> bytes every holder lands
    offsets = []
    moved = total = n_reads = deliveries = 0
    for band in bands:
        offsets.append(n_reads)
        n_reads += len(band.reads)
        for r in band.reads:
            read_bytes[r.reader] += r.nbytes
        for p in band.pieces:
            src = band.reads[p.read].reader
            if p.dest == EVERY_HOLDER:
                holders = sets[p.target]
                inside = src in holders  # type: ignore[operator]
                copies = len(holders) - inside  # type: ignore[arg-type]
                total += p.nbytes * len(holders)  # type: ignore[arg-type]
                moved += p.nbytes * copies
                if p.via < 0 or p.via == src:
                    sent_bytes[src] += p.nbytes * copies
                else:  # once to the via, which forwards it to the other holders
                    sent_bytes[src] += p.nbytes
                    sent_bytes[p.via] += p.nbytes * (copies - 1)
                landed[p.target] = landed.get(p.target, 0) + p.nbytes
                deliveries += len(holders)  # type: ignore[arg-type]
                if inside:
                    recv_bytes[src] -= p.nbytes
                continue
            total += p.nbytes
            deliveries += 1
            if p.dest != src:
                moved += p.nbytes
                sent_bytes[src] += p.nbytes
                recv_bytes[p.dest] += p.nbytes
    received = np.asarray(recv_bytes, dtype=np.int64)
    for t, n in landed.items():
        received[np.asarray(targets[t].holders)] += n
    return Template(
        targets=targets,
        bands=bands,
        ties=ties,
        read_bytes=np.asarray(read_bytes, dtype=np.int64),
        sent_bytes=np.asarray(sent_bytes, dtype=np.int64),
        recv_bytes=received,
        read_offsets=tuple(offsets),
        n_reads=n_reads,
        moved=moved,
        total=total,
        holder_sets=sets,
        deliveries=deliveries,
    )


def _read_boxes(
    chunk: Box,
    encoding: str,
    parts: list[tuple[Box, int]],
    strategy: str,
    targets: Sequence[Held],
) -> list[tuple[Box, list[tuple[Box, int, tuple[int, ...]]]]]:
    """The reads of one chunk's rows in one band: (read box, [(region, target, dests)]).

    exchange: one read covering every needed row, for all destinations.
    direct: one read per destination, covering only the rows that destination needs.
    """
    if encoding != "raw" or strategy == "exchange":
        box = chunk if encoding != "raw" else _row_cover(chunk, [b for b, _ in parts])
        return [(box, [(b, t, targets[t].holders) for b, t in parts])]
    per_dest: dict[int, list[tuple[Box, int]]] = {}
    for b, t in parts:
        for h in targets[t].holders:
            per_dest.setdefault(h, []).append((b, t))
    return [
        (_row_cover(chunk, [b for b, _ in ps]), [(b, t, (h,)) for b, t in ps])
        for h, ps in sorted(per_dest.items())
    ]


def _row_cover(chunk: Box, boxes: list[Box]) -> Box:
    """The rows of ``chunk`` (full width) spanning ``boxes``: one contiguous byte range."""
    if chunk.ndim == 0:
        return chunk
    if len(boxes) == 1:
        lo = boxes[0].offsets[0]
        hi = lo + boxes[0].sizes[0]
    else:
        lo = min(b.offsets[0] for b in boxes)
        hi = max(b.offsets[0] + b.sizes[0] for b in boxes)
    if lo == chunk.offsets[0] and hi - lo == chunk.sizes[0]:
        return chunk  # every row of it
    return Box.trusted((lo, *chunk.offsets[1:]), (hi - lo, *chunk.sizes[1:]))


def _byte_offset(chunk: Box, band: Box, isz: int) -> int:
    if chunk.ndim == 0:
        return 0
    return (band.offsets[0] - chunk.offsets[0]) * math.prod(chunk.sizes[1:]) * isz
