"""Execute a :class:`~reshard_svc.plan.read.ReadPlan`: per wave, this rank's ranged reads
(:mod:`reshard_svc.runtime.reading`), one ``all_to_all``, then every part landed in its
destination on its rank.

Every rank calls :func:`execute` with the same plan and walks the same waves, so the
collectives line up. Packing order is the plan's part order (reader, dest, read, box) on
both sides; each part starts 8-byte aligned so it can be viewed as any dtype in place.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from reshard_svc.format.checksums import BlockTable
from reshard_svc.plan.read import Part, Read, ReadPlan, Wave
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.reading import WaveReader
from reshard_svc.storage import Storage

__all__ = ["Destination", "Progress", "ProgressInfo", "execute"]

logger = logging.getLogger(__name__)


class Destination(Protocol):
    """Where the executor lands a plan's parts on this rank."""

    def view(self, part: Part) -> torch.Tensor:
        """The CPU tensor region ``part`` lands in (the executor copies into it, or reads
        straight into it from a local file)."""
        ...

    def take(self, part: Part, data: torch.Tensor) -> bool:
        """Keep ``data`` (``part.box`` in the source dtype) as it is, without a copy, and
        say True; or say False and the executor copies it into ``view(part)``."""
        ...

    def wave_done(self, wave: Wave) -> None:
        """Every part of ``wave`` for this rank has landed."""
        ...


@dataclass(frozen=True)
class ProgressInfo:
    """Reported after every wave; the same numbers on every rank."""

    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int

    def to_json(self) -> dict[str, int]:
        return {
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "tensors_done": self.tensors_done,
            "tensors_total": self.tensors_total,
        }


Progress = Callable[[ProgressInfo], None]


def _align(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class _MyWave:
    """One wave as this rank sees it: its reads, and the parts that cross between ranks
    (in plan order, the order of the ``all_to_all`` buffers on every rank)."""

    parts: tuple[Part, ...]
    readers: dict[int, Read]  # read id -> read
    mine: list[Read]  # the reads this rank performs
    parts_of: dict[int, list[Part]]  # read id -> its parts, for this rank's reads
    crossing: list[Part]

    @classmethod
    def of(cls, wave: Wave, me: int) -> _MyWave:
        reads, parts = wave.reads, wave.parts  # built from the plan's templates, once
        readers = {r.id: r for r in reads}
        parts_of: dict[int, list[Part]] = {}
        for p in parts:
            if readers[p.read].reader == me:
                parts_of.setdefault(p.read, []).append(p)
        crossing = [p for p in parts if readers[p.read].reader != p.dest]
        return cls(parts, readers, [r for r in reads if r.reader == me], parts_of, crossing)

    def piece(self, bands: Mapping[int, torch.Tensor], p: Part) -> torch.Tensor:
        """Part ``p`` inside the band this rank read for it."""
        r = self.readers[p.read]
        return bands[r.id][p.box.slices_in(r.box)]


def _all_to_all(
    w: _MyWave, bands: Mapping[int, torch.Tensor], comm: Comm, dtypes: Mapping[str, torch.dtype]
) -> torch.Tensor:
    """Send this rank's crossing parts (packed in plan order); return what it receives."""
    me = comm.rank
    if not w.crossing or comm.world == 1:
        return torch.empty(0, dtype=torch.uint8)
    send_splits = [0] * comm.world
    recv_splits = [0] * comm.world
    for p in w.crossing:
        src = w.readers[p.read].reader
        if src == me:
            send_splits[p.dest] += _align(p.nbytes)
        if p.dest == me:
            recv_splits[src] += _align(p.nbytes)
    send = torch.empty(sum(send_splits), dtype=torch.uint8)
    off = 0
    for p in w.crossing:
        if w.readers[p.read].reader == me:
            slot = send[off : off + p.nbytes].view(dtypes[w.readers[p.read].tensor])
            slot.view(p.box.sizes).copy_(w.piece(bands, p))
            off += _align(p.nbytes)
    return comm.all_to_all(send, send_splits, recv_splits).cpu()


def _land(
    w: _MyWave,
    bands: Mapping[int, torch.Tensor],
    recv: torch.Tensor,
    me: int,
    dest: Destination,
    dtypes: Mapping[str, torch.dtype],
    in_place: set[Part],
) -> None:
    """Every part of the wave for this rank into ``dest``: taken as is (``dest.take``) or
    copied into ``dest.view``; its own reads' parts first (unless read in place), then
    what it received, in plan order."""

    def land(p: Part, data: torch.Tensor) -> None:
        if not dest.take(p, data):
            dest.view(p).copy_(data)

    for p in w.parts:
        if p.dest == me and w.readers[p.read].reader == me and p not in in_place:
            land(p, w.piece(bands, p))
    off = 0
    for p in w.crossing:
        if p.dest == me:
            data = recv[off : off + p.nbytes].view(dtypes[w.readers[p.read].tensor])
            land(p, data.view(p.box.sizes))
            off += _align(p.nbytes)


def execute(
    plan: ReadPlan,
    storage: Storage,
    dtypes: Mapping[str, torch.dtype],
    comm: Comm,
    dest: Destination,
    progress: Progress | None = None,
    blocks: Mapping[str, BlockTable] | None = None,
    check_in_place: bool = True,
) -> int:
    """Run the plan on this rank; returns the bytes this rank read from storage.

    Reads of files with a block table (``blocks``, file name -> table) are widened to
    whole blocks and checked (:class:`CheckedReader`) before any byte is used; a
    mismatch raises :class:`~reshard_svc.errors.ChecksumError` on this rank and fails
    every rank at the wave's agreement point. ``check_in_place`` lets a checked read land
    in its destination first (see :class:`WaveReader`); ``convert`` turns it off, since
    it writes verified memory-mapped source bytes to its files without any copy.

    Each part for this rank lands in ``dest``: taken as is (``dest.take``) or copied
    into ``dest.view(part)``; when a read is exactly one such part on a local file, the
    bytes are read straight into its view (``preadv``, no staging buffer).
    ``dest.wave_done(wave)`` runs once every part of the wave has landed.
    """
    me = comm.rank
    total = plan.bytes_total
    tensors_total = plan.tensor_count
    done = tensors_done = 0
    bytes_read = 0
    # A failure in the destination is held until the next agreement point, so every
    # rank fails together instead of leaving peers blocked in all_to_all.
    pending: list[BaseException] = []

    reader = WaveReader(storage, dtypes, me, dest, blocks or {}, check_in_place)

    def read_or_fail(mine: list[Read], parts: dict[int, list[Part]]) -> list[torch.Tensor]:
        if pending:
            raise pending[0]
        return reader.read(mine, parts)

    for i, wave in enumerate(plan.waves):
        w = _MyWave.of(wave, me)
        reader.direct.clear()
        views, _ = comm.run_everywhere(
            f"reading wave {i + 1}/{len(plan.waves)}",
            functools.partial(read_or_fail, w.mine, w.parts_of),
        )
        bytes_read += sum(r.nbytes for r in w.mine if not reader.checked.covers(r))
        bands = {r.id: v for r, v in zip(w.mine, views)}
        del views
        recv = _all_to_all(w, bands, comm, dtypes)
        try:
            _land(w, bands, recv, comm.rank, dest, dtypes, reader.direct)
            del recv, bands  # buffers go back before the destination flushes
            dest.wave_done(wave)
        except Exception as e:  # surfaced on every rank at the next agreement
            pending.append(e)
        done += sum(p.nbytes for p in w.parts)
        tensors_done += wave.tensors_done
        if progress is not None:
            progress(ProgressInfo(done, total, tensors_done, tensors_total))
    comm.run_everywhere("finishing the exchange", lambda: read_or_fail([], {}))
    return bytes_read + reader.checked.bytes_fetched
