"""How a weight-sync push's pieces travel from this rank: :class:`Codec` sends each piece
as a delta against what it last sent when the receiver holds that version, else whole
(raw or delta, as the cost model in :mod:`~reshard_svc.sessions.sync.costs` prices it),
decodes what it receives into the push's :class:`~.landing.Landing`, and keeps what it
will record (deltas, views of the sources) until :meth:`Codec.record`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from reshard_svc.errors import DistributedError
from reshard_svc.plan.items import Piece, Wave
from reshard_svc.runtime import delta
from reshard_svc.sessions.sync.costs import Costs
from reshard_svc.sessions.sync.landing import Landing
from reshard_svc.sessions.sync.records import Agreed, Geometry, Records, Region

__all__ = ["Codec"]


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
    #: raw or delta, piece by piece (:mod:`reshard_svc.sessions.sync.costs`)
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
                d = delta.encode(old, data, raw_payload=False, density=share)
                self.bytes_compared += piece.nbytes
                self.priced_changes += piece.nbytes * self.costs.per_change * (share or 0.0)
            else:
                d = delta.RAW_UNSENT
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

    def decode(self, piece: Piece, encoding: int, payload: torch.Tensor) -> None:
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
