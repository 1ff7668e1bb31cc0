"""One tensor's read/exchange plan, relative to its chunk list: a *template*.

A DTensor checkpoint repeats itself: the 126 layers of a Llama-405B have the same seven
(shape, source layout, target layout) triples, so their plans differ only in which file
and byte offset each stored chunk sits at. :func:`build_template` plans one tensor in
chunk-relative terms (chunk index and byte skip instead of file and offset, target index
within the tensor); :mod:`reshard_svc.plan.read` plans each distinct template once and
instantiates it per tensor. The rules are those of the module docstring of
:mod:`reshard_svc.plan.read` (row bands, one reader per stored byte under ``exchange``).

Readers are chosen (:mod:`reshard_svc.plan.readers`) by the one rule every planner uses
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
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reshard_svc.layout import Box, overlaps
from reshard_svc.plan import readers
from reshard_svc.plan.items import Held, Piece
from reshard_svc.plan.readers import Relay, holder_group

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


@dataclass(frozen=True, eq=False, kw_only=True)
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

        bands = tuple(
            TBand(reads=b.reads, pieces=b.pieces, use=moved(b.use), peak=b.peak) for b in self.bands
        )
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
    relay = Relay(variant)
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
    relay: Relay,
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
            reader, tied = readers.choose_reader(
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
                members = holder_group(groups, t, dests)[1]
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
    band = TBand(reads=tuple(reads), pieces=tuple(parts), use=use, peak=int(use.max(initial=0)))
    return band, ties


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


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
