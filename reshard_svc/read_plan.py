"""The read/exchange plan behind ``load`` and ``convert``.

Pure: every rank computes the same plan from the source index and the wanted target boxes.

* **Row grid.** Each tensor is cut along dim 0 into global row bands of at most a quarter
  of the budget (full-width bytes). Stored chunks and target boxes are cut on the same
  grid, so everything one band of rows needs is read, moved and written together.
* **Reads.** A stored chunk's rows in one band are one contiguous byte range of its file.
  With ``exchange`` it is read by exactly one rank — the holder that receives most of it,
  else the least-loaded one — so each needed byte is read once per job. With ``direct``
  every destination reads the rows it needs itself and nothing is exchanged.
* **Parts.** A read's intersection with a target box goes to every holder of that box;
  the reader keeps its own and sends the rest.
* **Waves.** Whole row bands are grouped so that each rank's in-flight bytes (read
  buffers, send and receive buffers, target buffers) stay under the budget; each wave is
  one ``all_to_all``, and every target band is complete at the end of its wave.
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard_svc.boxes import overlaps
from reshard_svc.errors import UsageError
from reshard_svc.index import CheckpointIndex
from reshard_svc.layout import Box

__all__ = [
    "Part",
    "Read",
    "ReadPlan",
    "TargetBox",
    "Wave",
    "StorageCost",
    "band_limit",
    "choose_plan",
    "warn_if_over_budget",
    "plan_reads",
    "row_step",
    "split_rows",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetBox:
    tensor: str
    box: Box
    holders: tuple[int, ...]


@dataclass(frozen=True)
class Read:
    """One ranged read: rows of a stored chunk, ``[begin, end)`` of ``file``."""

    id: int
    tensor: str
    file: str
    begin: int
    end: int
    box: Box
    reader: int
    encoding: str = "raw"

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Part:
    """Region ``box`` of read ``read`` delivered into target ``target`` on rank ``dest``."""

    read: int
    box: Box
    target: int
    dest: int
    nbytes: int


@dataclass(frozen=True)
class Wave:
    """One ``all_to_all``: its reads, and the parts ordered by (reader, dest, read, box)."""

    reads: tuple[Read, ...]
    parts: tuple[Part, ...]
    #: tensors whose last row band is in this wave (for progress)
    tensors_done: int = 0


@dataclass(frozen=True)
class ReadPlan:
    """The whole plan; every rank computes the same one. Frozen once built."""

    targets: tuple[TargetBox, ...]
    waves: tuple[Wave, ...]
    world: int
    strategy: str

    @property
    def bytes_total(self) -> int:
        return sum(p.nbytes for w in self.waves for p in w.parts)

    def bytes_read(self) -> list[int]:
        out = [0] * self.world
        for w in self.waves:
            for r in w.reads:
                out[r.reader] += r.nbytes
        return out

    def reads_count(self) -> int:
        return sum(len(w.reads) for w in self.waves)

    def bytes_exchanged(self) -> int:
        reads = {r.id: r for w in self.waves for r in w.reads}
        return sum(p.nbytes for w in self.waves for p in w.parts if reads[p.read].reader != p.dest)


def warn_if_over_budget(index: CheckpointIndex, names: Iterable[str], budget: int) -> None:
    """Say (once per call) when one row of a tensor alone exceeds the budget's band."""
    if budget < 1:
        return  # plan_reads refuses it
    widest = max(
        ((math.prod(index.tensors[n].shape[1:]) * index.tensors[n].itemsize, n) for n in names
         if index.tensors[n].shape),
        default=(0, ""),
    )  # fmt: skip
    if widest[0] > band_limit(budget):
        logger.warning(
            "a memory budget of %d B cannot be met: one row of %r is %d B and a wave moves "
            "at least one row; waves will exceed it (give at least %d B)",
            budget, widest[1], widest[0], 4 * widest[0],
        )  # fmt: skip


def band_limit(budget: int) -> int:
    """Bytes of one global row band for a per-rank budget (read + send + recv + target)."""
    return max(1, budget // 4)


def row_step(shape: Sequence[int], itemsize: int, limit: int) -> int:
    """Rows per global band: as many full-width rows as fit in ``limit`` bytes (>= 1)."""
    if not shape:
        return 1
    row = max(1, math.prod(shape[1:]) * itemsize)
    return max(1, limit // row)


def split_rows(box: Box, step: int) -> list[Box]:
    """``box`` cut on the global row grid of ``step`` rows (0-dim boxes stay whole)."""
    if box.ndim == 0 or box.is_empty:
        return [box]
    lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
    cuts = [lo, *range((lo // step + 1) * step, hi, step), hi]
    return [Box((a, *box.offsets[1:]), (b - a, *box.sizes[1:])) for a, b in zip(cuts, cuts[1:])]


def plan_reads(
    index: CheckpointIndex,
    wanted: Mapping[str, Sequence[tuple[Box, tuple[int, ...]]]],
    world: int,
    budget: int,
    *,
    strategy: str = "exchange",
) -> ReadPlan:
    """Plan reading ``wanted`` (tensor -> distinct target boxes with holder ranks).

    Target boxes stay whole; ``convert`` passes boxes already cut with :func:`split_rows`
    on the same grid (:func:`row_step` of ``budget // 4``) so each is written when its
    wave ends.
    """
    if budget < 1:
        raise UsageError(f"memory budget must be positive, got {budget} bytes")
    if strategy not in ("exchange", "direct"):
        raise UsageError(f"strategy must be 'exchange' or 'direct', got {strategy!r}")
    targets: list[TargetBox] = []
    groups: list[list[tuple[Read, list[Part]]]] = []
    group_tensor: list[str] = []
    read_load = [0] * world
    limit = band_limit(budget)
    next_id = 0
    for name in sorted(wanted):
        meta = index.tensors[name]
        isz = meta.itemsize
        step = row_step(meta.shape, isz, limit)
        first = len(targets)
        for box, holders in wanted[name]:
            if not box.is_empty:
                targets.append(TargetBox(name, box, tuple(holders)))
        tboxes = [t.box for t in targets[first:]]
        chunks = list(meta.chunks)
        by_band: dict[int, list[tuple[int, Box, Box, int]]] = {}
        for o in overlaps([c.box for c in chunks], tboxes):
            chunk = chunks[o.src]
            bands = [chunk.box] if chunk.encoding != "raw" else split_rows(o.box, step)
            for piece in bands:
                key = (
                    -1 if chunk.encoding != "raw" else piece.offsets[0] // step if piece.ndim else 0
                )
                by_band.setdefault(key, []).append((o.src, piece, o.box, first + o.dst))
        for key in sorted(by_band):
            group: list[tuple[Read, list[Part]]] = []
            per_chunk: dict[int, list[tuple[Box, int]]] = {}
            for ci, piece, obox, t in by_band[key]:
                inter = obox if chunks[ci].encoding != "raw" else piece
                per_chunk.setdefault(ci, []).append((inter, t))
            for ci in sorted(per_chunk, key=lambda i: (chunks[i].file, chunks[i].begin)):
                chunk = chunks[ci]
                parts = per_chunk[ci]
                for read_box, rparts in _read_boxes(chunk, parts, strategy, targets):
                    encoded = chunk.encoding != "raw"
                    if encoded:
                        start, nb = chunk.begin, chunk.end - chunk.begin
                    else:
                        start = chunk.begin + _byte_offset(chunk.box, read_box, isz)
                        nb = read_box.numel * isz
                    recv: dict[int, int] = {}
                    for inter, _, dests in rparts:
                        for h in dests:
                            recv[h] = recv.get(h, 0) + inter.numel * isz
                    rot = zlib.crc32(f"{name}:{read_box.offsets}".encode()) % world
                    reader = max(recv, key=lambda r: (recv[r], -read_load[r], -((r - rot) % world)))
                    read_load[reader] += nb
                    read = Read(
                        next_id,
                        name,
                        chunk.file,
                        start,
                        start + nb,
                        read_box,
                        reader,
                        chunk.encoding,
                    )
                    next_id += 1
                    out = [
                        Part(read.id, inter, t, h, inter.numel * isz)
                        for inter, t, dests in rparts
                        for h in dests
                    ]
                    group.append((read, out))
            groups.append(group)
            group_tensor.append(name)
    return ReadPlan(tuple(targets), _waves(groups, group_tensor, world, budget), world, strategy)


def _read_boxes(
    chunk, parts: list[tuple[Box, int]], strategy: str, targets: list[TargetBox]
) -> list[tuple[Box, list[tuple[Box, int, tuple[int, ...]]]]]:
    """The reads of one chunk's rows in one band: (read box, [(region, target, dests)]).

    exchange: one read covering every needed row, for all destinations.
    direct: one read per destination, covering only the rows that destination needs.
    """
    if chunk.encoding != "raw" or strategy == "exchange":
        box = chunk.box if chunk.encoding != "raw" else _row_cover(chunk.box, [b for b, _ in parts])
        return [(box, [(b, t, targets[t].holders) for b, t in parts])]
    per_dest: dict[int, list[tuple[Box, int]]] = {}
    for b, t in parts:
        for h in targets[t].holders:
            per_dest.setdefault(h, []).append((b, t))
    return [
        (_row_cover(chunk.box, [b for b, _ in ps]), [(b, t, (h,)) for b, t in ps])
        for h, ps in sorted(per_dest.items())
    ]


def _row_cover(chunk: Box, boxes: list[Box]) -> Box:
    """The rows of ``chunk`` (full width) spanning ``boxes``: one contiguous byte range."""
    if chunk.ndim == 0:
        return chunk
    lo = min(b.offsets[0] for b in boxes)
    hi = max(b.offsets[0] + b.sizes[0] for b in boxes)
    return Box((lo, *chunk.offsets[1:]), (hi - lo, *chunk.sizes[1:]))


def _byte_offset(chunk: Box, band: Box, isz: int) -> int:
    if chunk.ndim == 0:
        return 0
    return (band.offsets[0] - chunk.offsets[0]) * math.prod(chunk.sizes[1:]) * isz


def _waves(
    groups: list[list[tuple[Read, list[Part]]]], group_tensor: list[str], world: int, budget: int
) -> tuple[Wave, ...]:
    """Pack whole row-band groups into waves under the per-rank byte budget."""
    last_group = {t: i for i, t in enumerate(group_tensor)}
    packed: list[tuple[list[Read], list[Part], int]] = []
    reads: list[Read] = []
    parts: list[Part] = []
    done = 0
    use = [0] * world
    for gi, group in enumerate(groups):
        add = [0] * world
        for read, rparts in group:
            add[read.reader] += read.nbytes
            for p in rparts:
                add[p.dest] += p.nbytes  # receive buffer or target buffer
                if p.dest != read.reader:
                    add[read.reader] += p.nbytes  # packed send buffer
        if reads and any(u + a > budget for u, a in zip(use, add)):
            packed.append((reads, parts, done))
            reads, parts, done, use = [], [], 0, [0] * world
        for read, rparts in group:
            reads.append(read)
            parts.extend(rparts)
        if last_group[group_tensor[gi]] == gi:
            done += 1
        use = [u + a for u, a in zip(use, add)]
    if reads:
        packed.append((reads, parts, done))
    readers = {r.id: r.reader for rs, _, _ in packed for r in rs}
    return tuple(
        Wave(
            tuple(rs), tuple(sorted(ps, key=lambda p: (readers[p.read], p.dest, p.read, p.box))), d
        )
        for rs, ps, d in packed
    )


@dataclass(frozen=True)
class StorageCost:
    """The cost model's inputs: the source storage's seconds per request and bytes per
    second, the exchange's bytes per second, and whether the storage is local files.

    Defaults come from the storage backend (``latency_s``, ``bandwidth``, ``local_files``);
    ``RESHARD_STORAGE_LATENCY_S``, ``RESHARD_STORAGE_BANDWIDTH`` and
    ``RESHARD_EXCHANGE_BANDWIDTH`` override them for a deployment that measured its own.
    """

    latency_s: float
    bandwidth: float
    exchange_bandwidth: float = 2.5e9  # gloo: ~2-3 GB/s per worker pair on one host
    local: bool = True

    @classmethod
    def of(cls, storage: Any) -> StorageCost:
        def env(name: str, default: float) -> float:
            raw = os.environ.get(name)
            try:
                value = float(raw) if raw else default
            except ValueError:
                raise UsageError(f"{name}={raw!r} is not a number") from None
            if value <= 0:
                raise UsageError(f"{name}={raw!r} must be positive")
            return value

        return cls(
            env("RESHARD_STORAGE_LATENCY_S", storage.latency_s),
            env("RESHARD_STORAGE_BANDWIDTH", storage.bandwidth),
            env("RESHARD_EXCHANGE_BANDWIDTH", cls.exchange_bandwidth),
            bool(storage.local_files),
        )

    def seconds(self, plan: ReadPlan) -> float:
        """Estimated wall time of ``plan``: requests and bytes read (over-reads included),
        spread over the workers, plus the bytes moved between them.

        cost = requests x latency / W + bytes read / bandwidth / W + bytes moved / exchange
        """
        w = max(1, plan.world)
        return (
            plan.reads_count() * self.latency_s / w
            + sum(plan.bytes_read()) / self.bandwidth / w
            + plan.bytes_exchanged() / self.exchange_bandwidth
        )


def choose_plan(
    index: CheckpointIndex,
    wanted: Mapping[str, Sequence[tuple[Box, tuple[int, ...]]]],
    world: int,
    budget: int,
    strategy: str,
    cost: StorageCost,
) -> ReadPlan:
    """``plan_reads`` for ``strategy``; ``auto`` plans both and keeps the cheaper one.

    Off local files (object stores: every request and byte is paid for) ``auto`` keeps
    exchange's read-once plan whenever ``direct`` would read more bytes.
    """
    if strategy not in ("auto", "exchange", "direct"):
        raise UsageError(f"strategy must be auto, exchange or direct, got {strategy!r}")
    if strategy != "auto":
        return plan_reads(index, wanted, world, budget, strategy=strategy)
    exchange = plan_reads(index, wanted, world, budget, strategy="exchange")
    direct = plan_reads(index, wanted, world, budget, strategy="direct")
    if not cost.local and sum(direct.bytes_read()) > sum(exchange.bytes_read()):
        return exchange
    return direct if cost.seconds(direct) < cost.seconds(exchange) else exchange
