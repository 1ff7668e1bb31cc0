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


def pack(costs: Iterable[np.ndarray], world: int, budget: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` ranges of consecutive items whose summed per-rank costs (arrays of
    ``world`` byte counts) stay within ``budget`` on every rank."""
    use = np.zeros(world, dtype=np.int64)
    start = count = 0
    for cost in costs:
        if count > start and bool(((use + cost) > budget).any()):
            yield start, count
            start = count
            use = np.zeros(world, dtype=np.int64)
        use += cost
        count += 1
    if count > start:
        yield start, count
