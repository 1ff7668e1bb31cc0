"""How a push's pieces travel, on this rank: the codec and the landing of a
:class:`~reshard_svc.sessions.sync.WeightSync` push.

The executor runs a push's plan with :class:`Codec` (each piece a sender sends: a delta
against what it last sent when the receiver holds that version, else the whole piece) and
:class:`Landing` as its destination (whole pieces staged, deltas decoded and kept; a wave
written into the targets once every rank has it, or at commit when the session holds).
Both are handed the session's :class:`Records` (the version each wave of this rank's
targets holds, what this rank last sent) and the :class:`Agreed` table of the push, never
the session itself. Neither changes the records before every rank has agreed to commit:
until then a push can be undone. The landing writes through a :class:`Journal` (the
elements it overwrote, as they were); the codec keeps what it will record (deltas, views
of the sources) until :meth:`Codec.record`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from reshard_svc.errors import DistributedError
from reshard_svc.layout import Box
from reshard_svc.plan.items import Piece, Read, Wave
from reshard_svc.plan.transfer import TransferPlan
from reshard_svc.runtime import delta
from reshard_svc.runtime.buffers import Arena
from reshard_svc.runtime.targets import Placed
from reshard_svc.runtime.transfer import Staging, TransferEntry
from reshard_svc.sessions.sync_costs import Costs

Region = tuple[int, Box]  # a region a sender sends: (read id, box)


@dataclass(kw_only=True)
class Records:
    """What one rank's session knows across pushes; the session owns it and hands it to
    each push's landing and codec.

    ``held``: wave -> the version this rank's targets hold (changed only when every rank
    has committed a push). ``sent``: wave -> the version of this rank's snapshots, and
    ``snapshots``: region -> a copy of what this rank last sent another rank."""

    held: dict[int, int | None] = field(default_factory=dict)
    sent: dict[int, int | None] = field(default_factory=dict)
    snapshots: dict[Region, torch.Tensor] = field(default_factory=dict)

    def clear(self) -> None:
        self.held.clear()
        self.sent.clear()
        self.snapshots.clear()


@dataclass(frozen=True, kw_only=True)
class Agreed:
    """What every rank said at ``begin()``: the version pushed and, per rank and wave, the
    version its targets hold (``held``) and its record of what it sent is of (``sent``)."""

    version: int
    held: list[list[int | None]]
    sent: list[list[int | None]]


@dataclass(kw_only=True)
class Geometry:
    """What the session derives from a plan once: each target's and read's wave, and the
    reads by id."""

    plan_id: int
    plan: TransferPlan
    wave_of_target: dict[int, int]
    wave_of_name: dict[str, int]
    wave_index: dict[int, int]  # id(wave) -> index
    reads: dict[int, Read]
    #: a relayed stripe -> every rank it reaches (a delta must suit them all)
    relayed: dict[Region, tuple[int, ...]]

    @classmethod
    def of(cls, entry: TransferEntry) -> Geometry:
        plan = entry.plan
        of_target, of_name, index, reads = {}, {}, {}, {}
        relayed: dict[Region, list[int]] = {}
        for wi, wave in enumerate(plan.waves):
            index[id(wave)] = wi
            for name in wave.tensors:
                of_name[name] = wi
            for r in wave.reads:
                reads[r.id] = r
            for p in wave.pieces:
                of_target[p.target] = wi
                if p.via >= 0:
                    relayed.setdefault((p.read, p.box), []).append(p.dest)
        return cls(
            plan_id=entry.plan_id,
            plan=plan,
            wave_of_target=of_target,
            wave_of_name=of_name,
            wave_index=index,
            reads=reads,
            relayed={k: tuple(v) for k, v in relayed.items()},
        )


def journal_pool() -> Arena:
    """Host buffers a session's journals reuse push after push (slabs of at least 64 MiB,
    kept at their high-water mark): a fresh allocation per push would fault in every
    page of what it keeps, which costs more than the copy. A journal's views are its own
    until :meth:`Journal.drop` resets the pool (releasing them)."""
    return Arena(slab=64 << 20, align=64, name="a sync session's undo journal buffer")


class Journal:
    """The elements a push overwrote in this rank's targets, as they were (on the host), so
    that a push that fails on any rank can be undone: a delta's changed elements, a whole
    piece's region (copied into the session's :func:`journal_pool`). At most ``budget`` bytes:
    past it the journal stops keeping and says it cannot undo (the session then fences
    the rank)."""

    def __init__(self, budget: int, pool: Arena | None = None) -> None:
        self.budget = budget
        self.pool = pool if pool is not None else journal_pool()
        self.entries: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.nbytes = 0
        self.complete = True

    def keep(self, region: torch.Tensor, where: torch.Tensor | None = None) -> None:
        """Before ``region`` (or its elements at ``where``) is overwritten."""
        if not self.complete:
            return
        if where is None:
            count = region.numel()
        elif where.dtype == torch.bool and where.device.type == "cpu":
            count = int(np.count_nonzero(where.numpy()))  # torch's sum is 20x slower
        else:
            count = int(where.sum()) if where.dtype == torch.bool else where.numel()
        size = region.element_size() * count
        if self.nbytes + size > self.budget:
            self.complete = False
            self.entries.clear()
            return
        if where is None and count:
            ints = delta.as_ints(region)
            old = self.pool.take(size).view(ints.dtype)
            old.view(region.shape).copy_(ints)
        else:
            old = delta.values_at(region, where)
        self.entries.append((region, where, old))
        self.nbytes += size

    def undo(self) -> bool:
        """Put every kept element back, newest first; True when the targets are as they
        were before the push."""
        whole = self.complete
        try:
            for region, where, old in reversed(self.entries):
                delta.patch(region, where, old)
        except Exception:  # a target that cannot be written back: the rank is fenced
            whole = False
        self.drop()
        return whole

    def drop(self) -> None:
        self.entries.clear()
        self.nbytes = 0
        self.complete = True
        self.pool.reset()


_NOTHING = torch.empty(0, dtype=torch.uint8)
#: a piece the cost model sends raw, without comparing it
_RAW = delta.Delta(encoding=delta.Encoding.RAW, payload=_NOTHING, where=None, values=_NOTHING)


def _forget(region: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Keep nothing of a region that held no version (the first push, a refill)."""


# ---- the destination and the codec


class Landing(Staging):
    """A push's destination on this rank: whole pieces land in staging (the plan's arena),
    deltas are decoded and kept; a wave is written into the targets once every rank has
    it (or at commit, when it is held)."""

    def __init__(
        self,
        plan: TransferPlan,
        dst: Mapping[str, Placed],
        arena: Arena,
        *,
        hold: bool,
        records: Records,
        geometry: Geometry,
        version: int,
        journal: Journal,
    ) -> None:
        super().__init__(plan, dst, arena)
        self.hold, self.records, self.geometry, self.version = hold, records, geometry, version
        self.journal = journal
        self.whole: dict[int, dict[Piece, None]] = {}  # target -> pieces staged whole
        self.patches: list[tuple[Piece, torch.Tensor | None, torch.Tensor]] = []
        self.parked: list[Wave] = []
        self.written: list[int] = []  # waves written into the targets, in order
        self.touched: list[str] = []  # their tensors (written, perhaps undone since)

    def wave_done(self, wave: Wave) -> None:
        """Every rank has the wave: write it, or, holding, park it until commit."""
        if self.hold:
            self.parked.append(wave)
        else:
            self._write(wave)

    def write_parked(self) -> None:
        for wave in self.parked:
            self._write(wave)
        self.parked.clear()

    def region(self, piece: Piece) -> torch.Tensor:
        """The piece's region of its target tensor."""
        t = self.plan.targets[piece.target]
        return self.dst[t.tensor].local[t.box][piece.box.slices_in(t.box)]

    def view(self, piece: Piece) -> torch.Tensor:
        self.whole.setdefault(piece.target, {})[piece] = None
        return super().view(piece)

    def keep_patch(self, piece: Piece, where: torch.Tensor | None, values: torch.Tensor) -> None:
        self.patches.append((piece, where, values))

    def _write(self, wave: Wave) -> None:
        wi = self.geometry.wave_index[id(wave)]
        self.written.append(wi)  # before any byte: a failure inside is undone too
        self.touched.extend(wave.tensors)
        # what the targets held is worth keeping only when it was a version
        keep = self.journal.keep if self.records.held.get(wi) is not None else _forget
        for ti, staged in self.staged.items():
            t = self.plan.targets[ti]
            into = self.dst[t.tensor].local[t.box]
            pieces = self.whole[ti]
            if sum(p.box.numel for p in pieces) == t.box.numel:
                keep(into)
                into.copy_(staged)
            else:
                for p in pieces:
                    at = p.box.slices_in(t.box)
                    keep(into[at])
                    into[at].copy_(staged[at])
        for p, where, values in self.patches:
            region = self.region(p)
            keep(region, where)
            delta.patch(region, where, values)
        self.staged.clear()
        self.whole.clear()
        self.patches.clear()
        self._pad(wave.tensors)
        self.updated.extend(wave.tensors)

    def _pad(self, names: Sequence[str]) -> None:
        for name in names:
            if name in self.dst:
                self.dst[name].fill_padding()

    def undo(self) -> bool:
        """Put back what this push wrote (a failure on any rank, or an abort): True when
        the targets hold what they held before it. Either way nothing is recorded."""
        whole = self.journal.undo()
        self._pad(self.touched)
        self.updated.clear()
        if not whole:  # what the written waves hold is no version: the next push refills
            for wi in self.written:
                self.records.held.pop(wi, None)
        return whole

    def record(self) -> None:
        """Every rank committed: the waves written hold the push's version."""
        self.journal.drop()
        for wi in self.written:
            self.records.held[wi] = self.version


@dataclass(kw_only=True)
class Codec:
    """Each piece a rank sends to another: a delta against what it last sent when the
    receiver holds that version, else the whole piece; and, once every rank has committed,
    the sender's record brought up to date."""

    records: Records
    agreed: Agreed
    geometry: Geometry
    landing: Landing
    #: every source tensor's dtype, as its holders pass it
    dtypes: Mapping[str, torch.dtype]
    verify: bool
    #: raw or delta, piece by piece (:mod:`reshard_svc.sessions.sync_costs`)
    costs: Costs
    bytes_sent: int = 0
    #: of which whole or raw
    bytes_raw: int = 0
    #: of which forwarded for a relay (received from a sender, sent on as received)
    bytes_forwarded: int = 0
    #: bytes compared for deltas, and what the cost model priced their changes at (s)
    bytes_compared: int = 0
    priced_changes: float = 0.0
    bytes_received: int = 0
    deltas: int = 0
    wholes: int = 0
    #: pieces sent, by how: "whole" (no delta possible), "raw", "mask", "runs", "gaps"
    encodings: dict[str, int] = field(default_factory=dict)
    #: wave -> {region: the delta sent, or the source view to copy at the write}
    pending: dict[int, dict[Region, delta.Delta | torch.Tensor]] = field(default_factory=dict)
    encoded: dict[Region, delta.Delta] = field(default_factory=dict)

    def _eligible(self, p: Piece, wave: int) -> bool:
        """A delta suits every rank the piece reaches (a relayed stripe's receivers all
        decode what its via forwards)."""
        sender = self.geometry.reads[p.read].reader
        base = self.agreed.sent[sender][wave]
        dests = self.geometry.relayed.get((p.read, p.box), (p.dest,))
        return base is not None and all(self.agreed.held[d][wave] == base for d in dests)

    def forwarded(self, piece: Piece, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.bytes_forwarded += nbytes

    def encode(self, piece: Piece, data: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        wave = self.geometry.wave_of_target[piece.target]
        key = (piece.read, piece.box)
        mine = self.pending.setdefault(wave, {})
        old = self.records.snapshots.get(key)
        if old is None or not self._eligible(piece, wave):
            mine.setdefault(key, data)
            self.wholes += 1
            self._count("whole")
            self.bytes_sent += piece.nbytes
            self.bytes_raw += piece.nbytes
            return 0, None
        d = self.encoded.get(key)
        if d is None:
            share = delta.sampled_density(old, data)
            if self.costs.delta_pays(piece.nbytes, data.element_size(), share):
                d = delta.encode(old, data, raw_payload=False)
                self.bytes_compared += piece.nbytes
                self.priced_changes += piece.nbytes * self.costs.per_change * (share or 0.0)
            else:
                d = _RAW
            self.encoded[key] = d
            mine[key] = d if d.encoding in (delta.Encoding.RUNS, delta.Encoding.GAPS) else data
        self.deltas += 1
        self._count(d.encoding.name.lower())
        if d.encoding is delta.Encoding.RAW:
            self.bytes_sent += piece.nbytes
            self.bytes_raw += piece.nbytes
            return 0, None
        self.bytes_sent += d.payload.numel()
        return int(d.encoding), d.payload

    def _count(self, how: str) -> None:
        self.encodings[how] = self.encodings.get(how, 0) + 1

    def decode(self, piece: Piece, encoding: int, payload: torch.Tensor, dest: Any) -> None:
        wave = self.geometry.wave_of_target[piece.target]
        sender = self.geometry.reads[piece.read].reader
        self.bytes_received += payload.numel()
        if encoding and not self._eligible(piece, wave):
            raise DistributedError(
                f"rank {sender} sent a delta of {self.landing.plan.targets[piece.target].tensor!r}"
                " to a rank that does not hold the version it is against"
            )
        dtype = self.dtypes[self.geometry.reads[piece.read].tensor]
        if encoding == delta.Encoding.RAW:
            if payload.numel() != piece.nbytes:
                raise DistributedError(
                    f"rank {sender} sent {payload.numel()} bytes for a piece of {piece.nbytes}"
                )
            self.landing.view(piece).copy_(payload.view(dtype).view(piece.box.sizes))
            return
        where, values = delta.decode(encoding, payload, piece.box.numel, dtype)
        if self.verify:  # patched in staging, so the CRC32C is checked before writing
            staged = self.landing.view(piece)
            staged.copy_(self.landing.region(piece))
            delta.patch(staged, where, values)
        else:
            self.landing.keep_patch(piece, where, values)

    def wave_done(self, wave: Wave) -> None:
        self.encoded.clear()

    def record(self) -> None:
        """Every rank committed: this rank's record of what it sent becomes the push's
        version (until then it stays the last committed one, which a failed push keeps)."""
        snapshots = self.records.snapshots
        for wave, regions in self.pending.items():
            self.records.sent.pop(wave, None)  # until every record of the wave is new
            for key, what in regions.items():
                if isinstance(what, delta.Delta):
                    delta.patch(snapshots[key], what.where, what.values)
                elif key in snapshots:
                    snapshots[key].copy_(what)
                else:
                    snapshots[key] = what.contiguous().clone()
            self.records.sent[wave] = self.agreed.version
        self.pending.clear()
