"""The undo journal of a weight-sync push: what it overwrote in this rank's targets, as
it was, so that a push that fails on any rank can be undone; and the pool of host buffers
a session's journals reuse push after push."""

from __future__ import annotations

import numpy as np
import torch

from reshard_svc.runtime import delta
from reshard_svc.runtime.buffers import Arena

__all__ = ["Journal", "journal_pool"]


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
