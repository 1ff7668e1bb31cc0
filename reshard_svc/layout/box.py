"""Boxes of a global tensor, and overlap planning between two chunk lists of one tensor.

:func:`overlaps` finds every non-empty intersection between source boxes ``S`` and target
boxes ``T`` with a per-dimension interval sweep: group both sides by their interval on dim
0, sweep the distinct intervals to find overlapping groups, and recurse on the next dim for
each overlapping pair. For chunk lists that tile a tensor this is
O((|S|+|T|) log(|S|+|T|) + output), never the |S|·|T| of all pairs. Target boxes that fill
the grid of their per-dim intervals (every layout's do) take a shorter way: one sweep per
dim, then each source box looks its targets up by the intervals it meets.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from reshard_svc.errors import InconsistentIndexError, LayoutError

__all__ = ["Box", "Overlap", "check_tiling", "overlaps"]


@dataclass(frozen=True, order=True)
class Box:
    """A hyper-rectangle of a global tensor: ``offsets`` and ``sizes`` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if len(self.offsets) != len(self.sizes):
            raise LayoutError(f"box offsets {self.offsets} and sizes {self.sizes} differ in length")

    @classmethod
    def trusted(cls, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
        """A box from tuples of ints of equal length that the caller computed (no checks):
        the planners build hundreds of thousands of them."""
        box = object.__new__(cls)
        object.__setattr__(box, "offsets", offsets)
        object.__setattr__(box, "sizes", sizes)
        return box

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def is_empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when it is empty."""
        offs = []
        sizes = []
        for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo = max(a, b)
            hi = min(a + sa, b + sb)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box.trusted(tuple(offs), tuple(sizes))

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + sb <= a + sa
            for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def relative_to(self, outer: Box) -> Box:
        """This box with offsets measured from ``outer``'s corner."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)

    def slices_in(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds exactly ``outer``."""
        return tuple(
            slice(i - o, i - o + s) for o, i, s in zip(outer.offsets, self.offsets, self.sizes)
        )

    def to_json(self) -> dict[str, list[int]]:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes)}


class Overlap(NamedTuple):
    """``box`` is where ``source[src]`` and ``target[dst]`` overlap (global coordinates)."""

    src: int
    dst: int
    box: Box


Interval = tuple[int, int]  # [start, end)


def _interval_pairs(a: Sequence[Interval], b: Sequence[Interval]) -> list[tuple[int, int]]:
    """Index pairs (i, j) with a[i] and b[j] overlapping; sweep over starts."""
    events = sorted(
        [(iv[0], 0, i) for i, iv in enumerate(a)] + [(iv[0], 1, j) for j, iv in enumerate(b)]
    )
    active: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])  # heaps of (end, idx)
    out: list[tuple[int, int]] = []
    ivs = (a, b)
    for start, side, idx in events:
        other = active[1 - side]
        while other and other[0][0] <= start:
            heapq.heappop(other)
        end = ivs[side][idx][1]
        if end <= start:
            continue
        for _, o in other:
            out.append((idx, o) if side == 0 else (o, idx))
        heapq.heappush(active[side], (end, idx))
    return out


def _join(
    src: Sequence[Box],
    dst: Sequence[Box],
    s_ids: list[int],
    t_ids: list[int],
    dim: int,
    ndim: int,
    out: list[Overlap],
) -> None:
    if dim == ndim:
        for i in s_ids:
            for j in t_ids:
                box = src[i].intersect(dst[j])
                if box is not None:
                    out.append(Overlap(i, j, box))
        return
    s_groups: dict[Interval, list[int]] = {}
    for i in s_ids:
        b = src[i]
        s_groups.setdefault((b.offsets[dim], b.offsets[dim] + b.sizes[dim]), []).append(i)
    t_groups: dict[Interval, list[int]] = {}
    for j in t_ids:
        b = dst[j]
        t_groups.setdefault((b.offsets[dim], b.offsets[dim] + b.sizes[dim]), []).append(j)
    s_keys = list(s_groups)
    t_keys = list(t_groups)
    for gi, gj in _interval_pairs(s_keys, t_keys):
        _join(src, dst, s_groups[s_keys[gi]], t_groups[t_keys[gj]], dim + 1, ndim, out)


def overlaps(source: Sequence[Box], target: Sequence[Box]) -> list[Overlap]:
    """Every non-empty intersection of a source box with a target box.

    Results are sorted by (dst, src). Boxes must all have the same number of dims;
    0-dim (scalar) boxes intersect when both are non-empty.
    """
    if not source or not target:
        return []
    ndim = source[0].ndim
    for b in (*source, *target):
        if b.ndim != ndim:
            raise InconsistentIndexError(f"box {b} has {b.ndim} dims where {ndim} were expected")
    s_ids = [i for i, b in enumerate(source) if not b.is_empty]
    t_ids = [j for j, b in enumerate(target) if not b.is_empty]
    out: list[Overlap] = []
    if len(t_ids) == 1:  # one target box (a replicated tensor): no join to build
        j = t_ids[0]
        for i in s_ids:
            box = source[i].intersect(target[j])
            if box is not None:
                out.append(Overlap(i, j, box))
        return out  # already in (dst, src) order
    if not ndim or not _on_a_grid(source, target, s_ids, t_ids, ndim, out):
        _join(source, target, s_ids, t_ids, 0, ndim, out)
    out.sort(key=_DST_SRC)
    return out


_DST_SRC = operator.itemgetter(1, 0)


def _on_a_grid(
    src: Sequence[Box],
    dst: Sequence[Box],
    s_ids: list[int],
    t_ids: list[int],
    ndim: int,
    out: list[Overlap],
) -> bool:
    """The overlaps when the target boxes fill most of the grid of their intervals (any
    layout's boxes do: each is one interval per dim): each dim's source and target
    intervals are swept once, and each source box looks its targets up by the intervals
    it meets on every dim. False (nothing added) when the grid is mostly holes, where the
    lookups could outnumber the overlaps: :func:`_join` then."""
    t_ivs: list[dict[Interval, int]] = [{} for _ in range(ndim)]
    at: dict[tuple[int, ...], list[int]] = {}  # target intervals (one id per dim) -> targets
    for j in t_ids:
        b = dst[j]
        key = tuple(
            ivs.setdefault((o, o + n), len(ivs)) for ivs, o, n in zip(t_ivs, b.offsets, b.sizes)
        )
        at.setdefault(key, []).append(j)
    if 2 * len(at) < math.prod(map(len, t_ivs)):
        return False
    s_ivs: list[dict[Interval, int]] = [{} for _ in range(ndim)]
    s_keys = []
    for i in s_ids:
        sb = src[i]
        s_keys.append(
            tuple(
                ivs.setdefault((o, o + n), len(ivs))
                for ivs, o, n in zip(s_ivs, sb.offsets, sb.sizes)
            )
        )
    # per dim, per source interval: the target intervals it meets, as (id, offset, size)
    meets: list[list[list[tuple[int, int, int]]]] = []
    for d in range(ndim):
        sv, tv = list(s_ivs[d]), list(t_ivs[d])
        per: list[list[tuple[int, int, int]]] = [[] for _ in sv]
        for si, ti in _interval_pairs(sv, tv):
            lo, hi = max(sv[si][0], tv[ti][0]), min(sv[si][1], tv[ti][1])
            per[si].append((ti, lo, hi - lo))
        meets.append(per)
    for i, key in zip(s_ids, s_keys):
        for combo in itertools.product(*(m[k] for m, k in zip(meets, key))):
            ids, offs, sizes = zip(*combo)
            for j in at.get(ids, ()):
                out.append(Overlap(i, j, Box.trusted(offs, sizes)))
    return True


def check_tiling(shape: Sequence[int], boxes: Sequence[Box], what: str = "tensor") -> None:
    """Raise :class:`InconsistentIndexError` unless ``boxes`` tile ``shape`` exactly.

    Boxes must lie inside the tensor, overlap nowhere and cover every element.
    """
    full = Box(tuple(0 for _ in shape), tuple(shape))
    nonempty = [b for b in boxes if not b.is_empty]
    for b in nonempty:
        if b.ndim != len(shape) or not full.contains(b):
            raise InconsistentIndexError(
                f"{what}: chunk {b.offsets}+{b.sizes} lies outside shape {tuple(shape)}"
            )
    for o in overlaps(nonempty, nonempty):
        if o.src < o.dst:
            a, b = nonempty[o.src], nonempty[o.dst]
            raise InconsistentIndexError(
                f"{what}: chunks {a.offsets}+{a.sizes} and {b.offsets}+{b.sizes} overlap"
            )
    covered = sum(b.numel for b in nonempty)
    if covered != full.numel:
        raise InconsistentIndexError(
            f"{what}: chunks cover {covered} of {full.numel} elements of shape "
            f"{tuple(shape)}; some region has no chunk"
        )
