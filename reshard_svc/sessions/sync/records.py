"""What a weight-sync session knows across pushes, and what a push's ranks agreed.

:class:`Records` (the version each wave of this rank's targets holds, what this rank last
sent) is the session's; :class:`Agreed` is what every rank said when a push began;
:class:`Geometry` is what the session derives from a plan once. The landing and the codec
are handed these, never the session itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from reshard_svc.errors import TransferError
from reshard_svc.layout import Box
from reshard_svc.plan.items import Read
from reshard_svc.plan.transfer import TransferPlan
from reshard_svc.runtime.transfer import TransferEntry

__all__ = ["Agreed", "Geometry", "Records", "Region"]

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

    @classmethod
    def of(cls, version: int, table: list[Any]) -> Agreed:
        """What every rank said (``table``: each rank's version, its last committed one,
        ``held`` and ``sent``), or :class:`~reshard_svc.errors.TransferError` on every rank
        when the ranks push different versions or the version does not go up."""
        other = [(r, t["version"]) for r, t in enumerate(table) if t["version"] != version]
        if other:
            shown = ", ".join(f"rank {r}: {v}" for r, v in other[:5])
            raise TransferError(
                f"every rank must push the same version: this rank pushes {version}, {shown}"
            )
        done = [(t["committed"], r) for r, t in enumerate(table) if t["committed"] is not None]
        if done:
            last, rank = max(done)
            if version <= last:
                raise TransferError(
                    f"version {version} does not come after version {last}, which rank {rank} "
                    "committed: versions must go up (a restarted trainer pushes a new version)"
                )
        return cls(
            version=version, held=[t["held"] for t in table], sent=[t["sent"] for t in table]
        )


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
