"""One packer for every plan: consecutive items into groups under a per-rank byte budget.

A read plan packs row bands into waves; a transfer plan packs whole target tensors. Each
item costs some bytes on each rank (buffers it needs while in flight); a group closes
before the item that would take any rank over the budget. An item over the budget alone
gets a group of its own (callers decide whether that is an error or a warning).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

__all__ = ["pack"]


def pack(
    costs: Iterable[np.ndarray],
    world: int,
    budget: int,
    peaks: Iterable[int] | None = None,
) -> Iterator[tuple[int, int]]:
    """``[start, end)`` ranges of consecutive items whose summed per-rank costs (arrays of
    ``world`` byte counts) stay within ``budget`` on every rank. ``peaks``, when given, is
    each cost's largest entry (a band's, known once for every tensor that shares it): a
    group whose bound (the sum of its peaks) stays within the budget needs no check of
    every rank."""
    use = np.zeros(world, dtype=np.int64)
    high = 0  # at least use.max(): the sum of the group's peaks, or use.max() itself
    start = count = 0
    peak_of = iter(peaks) if peaks is not None else None
    for cost in costs:
        peak = next(peak_of) if peak_of is not None else int(cost.max(initial=0))
        if count > start and high + peak > budget:
            if bool(((use + cost) > budget).any()):
                yield start, count
                start = count
                use = np.zeros(world, dtype=np.int64)
                high = 0
            else:
                use += cost
                high = int(use.max())
                count += 1
                continue
        use += cost
        high += peak
        count += 1
    if count > start:
        yield start, count
