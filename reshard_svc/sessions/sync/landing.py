"""A weight-sync push's destination on this rank: whole pieces staged, deltas decoded and
kept; a wave written into the targets (through the push's :class:`~.journal.Journal`) once
every rank has it, or at commit when the session holds. Nothing is recorded before every
rank has agreed to commit: until then the push can be undone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from reshard_svc.plan.items import Piece, Wave
from reshard_svc.plan.transfer import TransferPlan
from reshard_svc.runtime import delta
from reshard_svc.runtime.buffers import Arena
from reshard_svc.runtime.targets import Placed
from reshard_svc.runtime.transfer import Staging
from reshard_svc.sessions.sync.journal import Journal
from reshard_svc.sessions.sync.records import Geometry, Records

__all__ = ["Landing"]


def _forget(region: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Keep nothing of a region that held no version (the first push, a refill)."""


class Landing:
    """A push's destination on this rank (the executor's ``Destination``): whole pieces
    land in a one-shot transfer's :class:`~reshard_svc.runtime.transfer.Staging` (the
    plan's arena), deltas are decoded and kept; a wave is written into the targets once
    every rank has it (or at commit, when it is held)."""

    def __init__(
        self,
        plan: TransferPlan,
        dst: Mapping[str, Placed],
        arena: Arena,
        *,
        hold: bool,
        records: Records,
        geometry: Geometry,
        journal: Journal,
    ) -> None:
        self.plan, self.dst = plan, dst
        self.staging = Staging(plan, dst, arena)
        self.hold, self.records, self.geometry = hold, records, geometry
        self.journal = journal
        self.updated: list[str] = []  # tensors written (a push's result)
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
        return self.staging.view(piece)

    def take(self, piece: Piece, data: torch.Tensor) -> bool:
        return False  # every piece is copied into staging (the targets change at the write)

    def keep_patch(self, piece: Piece, where: torch.Tensor | None, values: torch.Tensor) -> None:
        self.patches.append((piece, where, values))

    def _write(self, wave: Wave) -> None:
        wi = self.geometry.wave_index[id(wave)]
        self.written.append(wi)  # before any byte: a failure inside is undone too
        self.touched.extend(wave.tensors)
        # what the targets held is worth keeping only when it was a version
        keep = self.journal.keep if self.records.held.get(wi) is not None else _forget
        for ti, staged in self.staging.staged.items():
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
        self.staging.staged.clear()
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

    def record(self, version: int) -> None:
        """Every rank committed: the waves written hold the push's ``version``."""
        self.journal.drop()
        for wi in self.written:
            self.records.held[wi] = version
