"""Execute a :class:`~reshard_svc.read_plan.ReadPlan`: ranged reads, then one
``all_to_all`` per wave, then every part handed to a sink on its destination rank.

Every rank calls :func:`execute` with the same plan and walks the same waves, so the
collectives line up. Packing order is the plan's part order (reader, dest, read, box) on
both sides; each part starts 8-byte aligned so it can be viewed as any dtype in place.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from reshard_svc.checksums import BlockTable
from reshard_svc.errors import CorruptCheckpointError
from reshard_svc.read_plan import Part, Read, ReadPlan, Wave
from reshard_svc.runtime.buffers import tensor_runs
from reshard_svc.runtime.comm import Comm
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


#: Small reads of one file coalesce into mapped spans up to this size: big enough to share
#: edge blocks, small enough that one slab waiting for its write keeps little else mapped.
MAX_SPAN = 8 * 1024 * 1024
#: Reads checked in place need runs at least this long on average (else: memory map + copy).
MIN_CHECKED_RUN = 64 * 1024


def _align(n: int) -> int:
    return (n + 7) & ~7


def read_bands(storage: Storage, ranges: list[tuple[str, int, int]]) -> list[torch.Tensor]:
    """Read byte ranges into fresh uint8 tensors (positioned reads locally, concurrent
    ranged GETs on object stores)."""
    if storage.local_files:
        out = []
        for name, start, end in ranges:
            buf = torch.empty(end - start, dtype=torch.uint8)
            storage.read_into(name, start, memoryview(buf.numpy()))  # type: ignore[arg-type]
            out.append(buf)
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers; we only read them
        return [
            torch.frombuffer(v, dtype=torch.uint8)
            if v.nbytes
            else torch.empty(0, dtype=torch.uint8)
            for v in storage.read_ranges(ranges)
        ]


def as_bytes(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over a (possibly read-only) buffer, without a copy."""
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers; we only read them
        return torch.frombuffer(view, dtype=torch.uint8)


class CheckedReader:
    """Reads whole CRC32C blocks and checks them before anyone sees a byte.

    One rank's reads of a file are coalesced into spans whose block-widened ranges touch;
    each span is fetched once (a memory map locally, one ranged GET elsewhere) and each
    block is checked once per execution, however many reads share it.
    """

    def __init__(self, storage: Any, tables: Mapping[str, BlockTable], mapped: bool) -> None:
        self.storage = storage
        self.tables = tables
        #: ``read_view`` maps the page cache, so the bytes read are exactly the blocks
        #: checked, each once (other backends fetch whole spans, shared blocks again)
        self.mapped = mapped
        self.done: dict[str, set[int]] = {}
        self.bytes_fetched = 0
        self.bytes_checked = 0

    def covers(self, read: Read) -> bool:
        return read.file in self.tables

    def read(self, reads: list[Read]) -> dict[int, torch.Tensor]:
        """Read id -> uint8 tensor of exactly ``[begin, end)`` (verified)."""
        out: dict[int, torch.Tensor] = {}
        spans: list[tuple[str, int, int, list[Read]]] = []
        for r in sorted(reads, key=lambda r: (r.file, r.begin)):
            lo, hi = self.tables[r.file].widen(r.begin, r.end)
            if (
                spans
                and spans[-1][0] == r.file
                and lo <= spans[-1][2]
                and max(hi, spans[-1][2]) - spans[-1][1] <= MAX_SPAN
            ):
                f, a, b, rs = spans[-1]
                spans[-1] = (f, a, max(b, hi), [*rs, r])
            else:
                spans.append((r.file, lo, hi, [r]))
        for name, lo, hi, rs in spans:
            view = self.storage.read_view(name, lo, hi)
            newly = self.tables[name].check(lo, view, self.done.setdefault(name, set()))
            self.bytes_checked += newly
            self.bytes_fetched += newly if self.mapped else hi - lo
            whole = as_bytes(view)
            for r in rs:
                out[r.id] = whole[r.begin - lo : r.end - lo]
        return out


def _band_view(read: Read, buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if read.encoding == "raw":
        if buf.storage_offset() % dtype.itemsize:
            buf = buf.clone()  # safetensors does not align tensors inside its data section
        return buf.view(dtype).reshape(read.box.sizes)
    from reshard_svc.dcp_pickle import decode_torch_save

    t = decode_torch_save(buf.numpy().tobytes(), f"{read.file}@{read.begin}")
    if tuple(t.shape) != read.box.sizes:
        raise CorruptCheckpointError(
            f"{read.file}@{read.begin}: item of {read.tensor!r} has shape {list(t.shape)}, "
            f"the metadata says {list(read.box.sizes)}"
        )
    return t.to(dtype).contiguous()


class WaveReader:
    """One rank's reads of each wave, each the cheapest safe way.

    * **in place**: a read that is exactly one part of this rank, landing in a few long
      runs of a local destination, is read straight into it (``preadv``);
    * **mapped and checked**: any other read of a file with a block table goes through
      :class:`CheckedReader`;
    * **buffered**: the rest (no block table, or object stores) is read into fresh buffers.

    ``direct`` holds the parts that already sit in their destination, so the executor
    does not deliver them again.
    """

    def __init__(
        self,
        storage: Any,
        dtypes: Mapping[str, torch.dtype],
        rank: int,
        dest: Destination,
        tables: Mapping[str, BlockTable],
        check_in_place: bool,
    ) -> None:
        self.storage = storage
        self.dtypes = dtypes
        self.rank = rank
        self.dest = dest
        self.local = storage.local_files
        self.checked = CheckedReader(storage, tables, mapped=self.local)
        self.check_in_place = check_in_place
        self.direct: set[Part] = set()

    def read(self, mine: list[Read], parts: dict[int, list[Part]]) -> list[torch.Tensor]:
        """This rank's reads of one wave, in order, as tensors of each read's box."""
        out: dict[int, torch.Tensor] = {}
        buffered, verified = [], []
        in_place: list[tuple[Read, tuple[Part, torch.Tensor, list[Any]]]] = []
        for r in sorted(mine, key=lambda r: (r.file, r.begin)):
            target = self._in_place_target(r, parts.get(r.id, ())) if self.local else None
            if target is not None:
                in_place.append((r, target))
            elif self.checked.covers(r):
                verified.append(r)
            else:
                buffered.append(r)
        # In-place reads first, in file order, so neighbours share their edge blocks; the
        # mapped reads then skip the blocks those checked.
        for r, target in in_place:
            out[r.id] = self._read_in_place(r, *target)
        by_id = {r.id: r for r in verified}
        for rid, raw in (self.checked.read(verified) if verified else {}).items():
            out[rid] = _band_view(by_id[rid], raw, self.dtypes[by_id[rid].tensor])
        bufs = read_bands(self.storage, [(r.file, r.begin, r.end) for r in buffered])
        for r, b in zip(buffered, bufs):
            out[r.id] = _band_view(r, b, self.dtypes[r.tensor])
        return [out[r.id] for r in mine]

    def _in_place_target(
        self, r: Read, parts: Sequence[Part]
    ) -> tuple[Part, torch.Tensor, list[Any]] | None:
        """(part, destination view, its memory runs) when ``r`` can be read straight into
        its destination: it is exactly one part of this rank, landing in few long runs."""
        if r.encoding != "raw":
            return None
        table = self.checked.tables.get(r.file)
        if table is not None and (not self.check_in_place or r.nbytes < 2 * table.block_size):
            return None  # small checked reads coalesce better when mapped
        own = [p for p in parts if p.dest == self.rank and p.box == r.box]
        if not own:
            return None
        view = self.dest.view(own[0])
        runs = tensor_runs(view) if view is not None else None
        if view is None or runs is None or view.dtype != self.dtypes[r.tensor]:
            return None
        if table is not None and len(runs) > 2 + r.nbytes // MIN_CHECKED_RUN:
            return None  # short rows: checking row by row costs more than map and copy
        return own[0], view, runs

    def _read_in_place(
        self, r: Read, part: Part, view: torch.Tensor, runs: list[Any]
    ) -> torch.Tensor:
        """Read ``r`` straight into its destination (``preadv``).

        With a block table, every block the read touches is checked: the whole ones right
        after they land (still in cache), a partial one at either edge through the
        page-cache map. A mismatch raises before any wave hook or caller sees the bytes.
        """
        table = self.checked.tables.get(r.file)
        if table is None:
            self.storage.read_runs(r.file, r.begin, runs)
        else:
            newly = self._check_edges(r, table) + self._read_checked_blocks(r, table, runs)
            self.checked.bytes_checked += newly
            self.checked.bytes_fetched += newly  # local: each block read once, wholly
        self.direct.add(part)
        return view

    def _check_edges(self, r: Read, table: BlockTable) -> int:
        """Check the partial blocks at either edge of ``r`` through the page-cache map
        (shared with the neighbouring reads, so each is checked once)."""
        done = self.checked.done.setdefault(r.file, set())
        bs, newly = table.block_size, 0
        for b in {r.begin // bs, (r.end - 1) // bs}:
            lo, hi = b * bs, min(table.size, (b + 1) * bs)
            if b not in done and (lo < r.begin or hi > r.end):
                newly += table.check(lo, self.storage.read_view(r.file, lo, hi), done)
        return newly

    def _read_checked_blocks(self, r: Read, table: BlockTable, runs: list[Any]) -> int:
        """``preadv`` ``r`` into ``runs`` one block at a time, checking each at once."""
        done = self.checked.done.setdefault(r.file, set())
        bs, newly = table.block_size, 0
        pos, batch, start = r.begin, [], r.begin
        for run in runs:
            off = 0
            while off < run.nbytes:
                stop = min(table.size, (pos // bs + 1) * bs)
                take = min(run.nbytes - off, stop - pos)
                batch.append(run[off : off + take])
                off += take
                pos += take
                if pos == stop or pos == r.end:
                    self.storage.read_runs(r.file, start, batch)
                    newly += table.check_pieces(start, batch, done)
                    batch, start = [], pos
        return newly


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
