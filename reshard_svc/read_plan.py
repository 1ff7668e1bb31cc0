"""The read/exchange plan behind ``load`` and ``convert``.

Pure: every rank computes the same plan from the source index and the wanted target boxes.

* **Pieces.** Target boxes are intersected with stored chunks by the interval sweep.
* **Reads.** The needed rows of each stored chunk are cut into row bands — contiguous
  byte ranges of its file, at most a quarter of the budget each — and every band is read
  by exactly one rank: the holder that receives most of it, else the least-loaded one.
  So each needed byte is read once per job, in large contiguous reads.
* **Parts.** A band's intersection with a target box goes to every holder of that box;
  the reader keeps its own and sends the rest.
* **Waves.** Bands are grouped so that each rank's in-flight bytes (read buffers + send
  buffer + receive buffer) stay under the budget; each wave is one ``all_to_all``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from reshard_svc.boxes import overlaps
from reshard_svc.errors import StateDictError
from reshard_svc.index import CheckpointIndex
from reshard_svc.layout import Box

__all__ = ["Part", "Read", "ReadPlan", "TargetBox", "Wave", "plan_reads"]


@dataclass(frozen=True)
class TargetBox:
    tensor: str
    box: Box
    holders: tuple[int, ...]


@dataclass(frozen=True)
class Read:
    """One ranged read: a row band of a stored chunk, ``[begin, end)`` of ``file``."""

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


@dataclass
class Wave:
    reads: list[Read] = field(default_factory=list)
    parts: list[Part] = field(default_factory=list)


@dataclass
class ReadPlan:
    targets: list[TargetBox]
    waves: list[Wave]
    world: int

    def bytes_read(self) -> list[int]:
        out = [0] * self.world
        for w in self.waves:
            for r in w.reads:
                out[r.reader] += r.nbytes
        return out

    def bytes_exchanged(self) -> int:
        reads = {r.id: r for w in self.waves for r in w.reads}
        return sum(p.nbytes for w in self.waves for p in w.parts if reads[p.read].reader != p.dest)


def plan_reads(
    index: CheckpointIndex,
    wanted: Mapping[str, Sequence[tuple[Box, tuple[int, ...]]]],
    world: int,
    budget: int,
) -> ReadPlan:
    """Plan reading ``wanted`` (tensor -> distinct target boxes with holder ranks)."""
    if budget < 1:
        raise StateDictError(f"memory budget must be positive, got {budget}")
    targets: list[TargetBox] = []
    bands: list[tuple[Read, list[Part]]] = []
    read_load = [0] * world
    band_limit = max(1, budget // 4)
    next_id = 0
    for name in sorted(wanted):
        meta = index.tensors[name]
        first = len(targets)
        for box, holders in wanted[name]:
            if not box.is_empty:
                targets.append(TargetBox(name, box, tuple(holders)))
        tboxes = [t.box for t in targets[first:]]
        chunks = list(meta.chunks)
        pieces = overlaps([c.box for c in chunks], tboxes)
        by_chunk: dict[int, list[tuple[Box, int]]] = {}
        for o in pieces:
            by_chunk.setdefault(o.src, []).append((o.box, first + o.dst))
        isz = meta.itemsize
        for ci in sorted(by_chunk, key=lambda i: (chunks[i].file, chunks[i].begin)):
            chunk = chunks[ci]
            need = by_chunk[ci]
            encoded = chunk.encoding != "raw"
            # An encoded item (DCP torch.save) can only be read and decoded whole.
            for band in [chunk.box] if encoded else _bands(chunk.box, need, isz, band_limit):
                b_off = _byte_offset(chunk.box, band, isz)
                nb = chunk.end - chunk.begin if encoded else band.numel * isz
                parts: list[tuple[Box, int]] = []
                for pbox, t in need:
                    inter = pbox.intersect(band)
                    if inter is not None:
                        parts.append((inter, t))
                recv: dict[int, int] = {}
                for inter, t in parts:
                    for h in targets[t].holders:
                        recv[h] = recv.get(h, 0) + inter.numel * isz
                rot = zlib.crc32(f"{name}:{band.offsets}".encode()) % world
                reader = max(recv, key=lambda r: (recv[r], -read_load[r], -((r - rot) % world)))
                read_load[reader] += nb
                start = chunk.begin + (0 if encoded else b_off)
                read = Read(
                    next_id, name, chunk.file, start, start + nb, band, reader, chunk.encoding
                )
                next_id += 1
                out_parts = [
                    Part(read.id, inter, t, h, inter.numel * isz)
                    for inter, t in parts
                    for h in targets[t].holders
                ]
                bands.append((read, out_parts))
    return ReadPlan(targets, _waves(bands, world, budget), world)


def _bands(chunk: Box, need: list[tuple[Box, int]], isz: int, limit: int) -> list[Box]:
    """Row bands of ``chunk`` covering the rows some piece needs, each <= ``limit`` bytes."""
    if chunk.ndim == 0:
        return [chunk]
    lo = min(b.offsets[0] for b, _ in need)
    hi = max(b.offsets[0] + b.sizes[0] for b, _ in need)
    row = math.prod(chunk.sizes[1:]) * isz
    step = max(1, limit // max(1, row))
    out = []
    for start in range(lo, hi, step):
        end = min(hi, start + step)
        out.append(Box((start, *chunk.offsets[1:]), (end - start, *chunk.sizes[1:])))
    return out


def _byte_offset(chunk: Box, band: Box, isz: int) -> int:
    if chunk.ndim == 0:
        return 0
    return (band.offsets[0] - chunk.offsets[0]) * math.prod(chunk.sizes[1:]) * isz


def _waves(bands: list[tuple[Read, list[Part]]], world: int, budget: int) -> list[Wave]:
    waves: list[Wave] = []
    cur = Wave()
    use = [0] * world
    for read, parts in bands:
        add = [0] * world
        add[read.reader] += read.nbytes
        for p in parts:
            if p.dest != read.reader:
                add[read.reader] += p.nbytes  # packed send buffer
                add[p.dest] += p.nbytes  # receive buffer
        if cur.reads and any(u + a > budget for u, a in zip(use, add)):
            waves.append(cur)
            cur, use = Wave(), [0] * world
        cur.reads.append(read)
        cur.parts.extend(parts)
        use = [u + a for u, a in zip(use, add)]
    if cur.reads:
        waves.append(cur)
    readers = {r.id: r.reader for w in waves for r in w.reads}
    for w in waves:
        w.parts.sort(key=lambda p: (readers[p.read], p.dest, p.read, p.box))
    return waves
