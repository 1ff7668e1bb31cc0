"""Who reads each stored byte of a template, and who forwards each stripe of a replicated
box (:mod:`reshard_svc.plan.template` plans with these).

Readers are chosen by the one rule every planner uses
(:func:`~reshard_svc.layout.balance.least_loaded`): the holder that receives most of a
read, then the one that has read least within the tensor, then a rotation by the
template's variant; over a heap of a replicated box's holders, over arrays of every rank,
or over the merged holders of disjoint replicated boxes, each choosing as the rule does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from reshard_svc.layout import Box
from reshard_svc.layout.balance import least_loaded
from reshard_svc.plan.items import Held

__all__ = ["Relay", "choose_reader", "disjoint_reader", "holder_group", "unit_boxes"]


class Relay:
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
            for piece in unit_boxes(box, cols, a, b):
                out.append((piece, piece.numel * nbytes // numel, v))
        return out


def unit_boxes(box: Box, cols: int, a: int, b: int) -> list[Box]:
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


def holder_group(
    groups: dict[int, tuple[np.ndarray, frozenset[int]]], target: int, holders: tuple[int, ...]
) -> tuple[np.ndarray, frozenset[int]]:
    got = groups.get(target)
    if got is None:
        got = groups[target] = (np.asarray(sorted(holders), dtype=np.int64), frozenset(holders))
    return got


def choose_reader(
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
            cand = holder_group(groups, t, dests)[0].tolist()
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
        got = disjoint_reader(rparts, itemsize, load, turn, groups, unions)
        if got is not None:
            return got
    bytes_to = np.zeros(len(load), dtype=np.int64)
    holds = np.zeros(len(load), dtype=bool)
    for inter, t, ds in rparts:
        idx = holder_group(groups, t, ds)[0] if len(ds) > 1 else np.asarray(ds, dtype=np.int64)
        bytes_to[idx] += inter.numel * itemsize
        holds[idx] = True
    cand = np.flatnonzero(holds)  # sorted, as least_loaded's ties are
    most = cand[bytes_to[cand] == bytes_to[cand].max()]  # the holders receiving most of it
    tied = most[load[most] == load[most].min()]  # then the least loaded
    return int(tied[turn % len(tied)]), len(most)


def disjoint_reader(
    rparts: list[tuple[Box, int, tuple[int, ...]]],
    itemsize: int,
    load: np.ndarray,
    turn: int,
    groups: dict[int, tuple[np.ndarray, frozenset[int]]],
    unions: dict[tuple[int, ...], np.ndarray | None],
) -> tuple[int, int] | None:
    """:func:`choose_reader`'s array rule where the parts' holder sets are disjoint (a row of
    column-split replicated targets: each rank receives its own target's part, so the
    ranks receiving most are the holders of the largest parts), without an array of every
    rank; None where the sets meet. ``unions`` keeps, per tuple of targets, their holders
    merged and sorted (or None: they meet)."""
    sizes = [inter.numel * itemsize for inter, _, _ in rparts]
    every = tuple(t for _, t, _ in rparts)
    if every not in unions:
        merged = np.concatenate([holder_group(groups, t, ds)[0] for _, t, ds in rparts])
        merged.sort()
        unions[every] = merged if bool((merged[1:] != merged[:-1]).all()) else None
    if unions[every] is None:
        return None
    top = max(sizes)
    key = tuple(t for t, n in zip(every, sizes) if n == top)
    most = unions.get(key)  # every's own merge when all parts tie
    if most is None:
        most = np.concatenate([groups[t][0] for t in key])
        most.sort()
        unions[key] = most
    low = load[most]
    tied = most[low == low.min()]  # then the least loaded
    return int(tied[turn % len(tied)]), len(most)
