"""The cost model that picks how a weight-sync sender sends a piece: as a delta, or raw.

A delta saves bytes on the link and spends CPU: the sender compares the piece with what it
sent last time and packs the changes, the receiver unpacks them, keeps what they overwrite
(the undo journal) and patches them in, and the sender patches its record. Where sending
is cheap (one host, a fast fabric) the CPU can cost more than the bytes it saves; where
the link is slow it is worth it down to dense changes. So each piece is weighed:

* **CPU per byte of piece at change density d**: ``fixed + per_change * d`` seconds,
  tuned by every push that went by deltas (:meth:`Costs.measured`), calibrated first
  on this machine (:meth:`Costs.calibrate`: the whole round
  on an 8 MiB bf16 piece at 1 % and 20 % changed, a fraction of a second; every rank
  calibrates at once, so a machine shared by many ranks is measured as shared);
* **link per byte**: measured as pushes go: the seconds of a push's data movement over the
  bytes this rank sent, from pushes that went (almost) all whole or raw. Until one has
  been measured (the first push of a session is whole) every eligible piece tries a delta;
* **the density** of a large piece is read off a sample of it (16 rows), before any full
  compare; a small piece tries a delta (its compare costs next to nothing).

A piece goes as a delta when ``cpu + delta bytes * link < piece bytes * link``, else raw:
never more than a full push costs, up to the model's error. Every rank's figures are
shared when a push begins and the push uses the median CPU and the cheapest link among
them (:meth:`Costs.agreed`), so every sender chooses alike. Only a cost decision: raw is always right.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc.runtime import delta

__all__ = ["Costs"]

#: a push measures the link only when at least this share of what it sent went whole/raw
_RAW_SHARE = 0.9
#: and it sent at least this many bytes (a tiny push's seconds are mostly latency)
_MEASURE_FROM = 1 << 20
#: a push by deltas tunes the per-change figure when its changes were priced at least this
#: share of its CPU, else the compare's
_CHANGES_SAY = 0.3


@dataclass(kw_only=True)
class Costs:
    """Seconds per byte of piece: CPU of a delta (``fixed + per_change * density``) and
    the link (None until measured)."""

    fixed: float
    per_change: float
    link: float | None = None
    #: whether a push's own seconds have tuned the compare's figure (a sender's have)
    tuned: bool = False

    @classmethod
    def calibrate(cls, elements: int = 1 << 22) -> Costs:
        """Time a delta's whole round on this machine at 1 % and 20 % changed."""
        g = torch.Generator().manual_seed(0)
        old = torch.randint(-(2**15), 2**15, (elements,), generator=g, dtype=torch.int16)
        old = old.view(torch.bfloat16).reshape(1024, -1)
        nbytes = old.numel() * old.element_size()
        per_byte = []
        for density in (0.01, 0.2):
            new = old.clone()
            flat = new.view(torch.int16).view(-1)
            flat[torch.rand(flat.numel(), generator=g) < density] ^= 1
            best = float("inf")
            for _ in range(2):
                best = min(best, _round(old, new))
            per_byte.append(best / nbytes)
        per_change = max(0.0, (per_byte[1] - per_byte[0]) / 0.19)
        return cls(fixed=max(0.0, per_byte[0] - 0.01 * per_change), per_change=per_change)

    def figures(self) -> list[float | bool | None]:
        """What this rank says at ``begin()``."""
        return [self.fixed, self.per_change, self.link, self.tuned]

    @classmethod
    def agreed(cls, figures: list[list[Any]]) -> Costs | None:
        """The push's model from every rank's :meth:`figures`: the median CPU (among the
        ranks whose pushes have tuned it, when any has: one rank descheduled while it
        calibrated must not price every push) and the cheapest link measured (None when
        no rank has figures)."""
        if not figures:
            return None
        tuned = [f for f in figures if len(f) > 3 and f[3]]
        cpus = tuned or figures
        links = [f[2] for f in figures if f[2] is not None]
        return cls(
            fixed=statistics.median(float(f[0] or 0.0) for f in cpus),
            per_change=statistics.median(float(f[1] or 0.0) for f in cpus),
            link=min(links) if links else None,
        )

    def cpu(self, nbytes: int, density: float) -> float:
        """Seconds of CPU a delta of a piece of ``nbytes`` at ``density`` costs."""
        return nbytes * (self.fixed + self.per_change * density)

    def delta_pays(self, nbytes: int, itemsize: int, density: float | None) -> bool:
        """Whether a piece of ``nbytes`` at ``density`` (None: unknown) is cheaper sent
        as a delta than raw."""
        if self.link is None or density is None:
            return True
        elements = nbytes // max(1, itemsize)
        changes = density * elements
        sent = min(elements / 8 + changes * itemsize, changes * (2 + itemsize))
        return self.cpu(nbytes, density) + sent * self.link < nbytes * self.link

    def measured(
        self, *, sent: int, raw: int, seconds: float, compared: int = 0, changes: float = 0.0
    ) -> None:
        """A push moved ``sent`` bytes from this rank (``raw`` of them whole or raw) in
        ``seconds``, comparing ``compared`` bytes whose changes the model priced at
        ``changes`` seconds: the link's figure, when the push went raw; the compare's
        (``fixed``), when it went by deltas (the calibration ran on a small piece; a push
        runs on the real ones, on a machine as busy as it is). ``per_change`` stays as
        calibrated: sparse pushes say little about it."""
        if seconds <= 0:
            return
        if sent >= _MEASURE_FROM and raw >= _RAW_SHARE * sent:
            self.link = seconds / sent
        elif compared >= _MEASURE_FROM and raw <= (1 - _RAW_SHARE) * max(sent, 1):
            spent = seconds - (sent * self.link if self.link is not None else 0.0)
            if changes >= _CHANGES_SAY * (changes + compared * self.fixed):
                # the changes were a fair share of the price: they say what a change costs
                scale = (spent - compared * self.fixed) / changes
                self.per_change *= min(10.0, max(0.1, scale))
            else:  # mostly the compare
                fixed = (spent - changes) / compared
                self.fixed = min(10 * self.fixed, max(0.1 * self.fixed, fixed))
            self.tuned = True


def _round(old: torch.Tensor, new: torch.Tensor) -> float:
    """Seconds of one delta's round: encode, decode, journal, patch, the sender's record."""
    target, record = old.clone(), old.clone()
    start = time.perf_counter()
    d = delta.encode(old, new, raw_payload=False)
    if d.encoding is not delta.Encoding.RAW:
        where, values = delta.decode(int(d.encoding), d.payload, new.numel(), new.dtype)
        delta.values_at(target, where)  # the receiver's undo journal
        delta.patch(target, where, values)
        delta.patch(record, d.where, d.values)  # the sender's record
    return time.perf_counter() - start
