"""Reading a wave's byte ranges on this rank: coalesced, block-checked, and where possible
straight into their destination.

:class:`StorageSource` is the executor's source for ``load`` and ``convert``
(:mod:`reshard_svc.runtime.executor`):
reads of files with a block table are widened to whole blocks and checked
(:class:`CheckedReader`) before any byte is used; a read that is exactly one part landing
on this rank, from a local file, goes straight into the destination's view.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from reshard_svc.errors import CorruptCheckpointError
from reshard_svc.format.checksums import BlockStream, BlockTable, Parts
from reshard_svc.plan.items import Piece, Read
from reshard_svc.runtime.buffers import tensor_bytes, tensor_runs
from reshard_svc.runtime.ring import PinnedRing, pinned_ring
from reshard_svc.storage import Storage

if TYPE_CHECKING:
    from reshard_svc.runtime.executor import Destination

__all__ = ["CheckedReader", "StorageSource", "as_bytes", "band_view", "read_bands"]

#: Small reads of one file coalesce into mapped spans up to this size: big enough to share
#: edge blocks, small enough that one slab waiting for its write keeps little else mapped.
MAX_SPAN = 8 * 1024 * 1024
#: Reads checked in place need runs at least this long on average (else: memory map + copy;
#: measured on 2 KiB rows, mapping, checking and copying beat staging through a buffer).
MIN_CHECKED_RUN = 64 * 1024
#: Checked bytes land in pieces of about this size, each checked right after it lands,
#: while still in cache (CRC32C then runs near 22 GB/s, against 13 from memory; smaller
#: pieces read slower).
CHUNK = 1024 * 1024


def read_bands(storage: Storage, ranges: list[tuple[str, int, int]]) -> list[torch.Tensor]:
    """Read byte ranges into fresh uint8 tensors (positioned reads locally, concurrent
    ranged GETs on object stores)."""
    if storage.local_files:
        out = []
        for name, start, end in ranges:
            buf = torch.empty(end - start, dtype=torch.uint8)
            with storage.positional(name) as readv:
                readv(start, [memoryview(buf.numpy())])  # type: ignore[arg-type]
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

    Offsets given to :meth:`cut` before a :meth:`read` split the blocks they fall in: each
    part is summed on its own during the check (the parts combined must give the block's
    CRC32C), so :meth:`crcs` can give the CRC32C of ranges that start and end at cuts or
    block bounds without reading their bytes again (a writer's blocks, built from them).
    """

    def __init__(self, storage: Storage, tables: Mapping[str, BlockTable], mapped: bool) -> None:
        self.storage = storage
        self.tables = tables
        #: ``read_view`` maps the page cache, so the bytes read are exactly the blocks
        #: checked, each once (other backends fetch whole spans, shared blocks again)
        self.mapped = mapped
        self.done: dict[str, set[int]] = {}
        self.bytes_fetched = 0
        self.bytes_checked = 0
        self._cuts: dict[str, set[int]] = {}
        self._parts: dict[str, Parts] = {}

    def cut(self, file: str, offsets: Sequence[int]) -> None:
        """Sum the blocks of ``file`` that the next :meth:`read` checks in parts, split at
        ``offsets``."""
        self._cuts.setdefault(file, set()).update(offsets)

    def crcs(self, file: str, bounds: Sequence[int]) -> list[tuple[int, int]] | None:
        """(length, CRC32C) of each range between consecutive ``bounds`` of ``file``, from
        what the checks summed; None if one of them was not summed that way."""
        table, parts = self.tables.get(file), self._parts.get(file)
        if table is None or parts is None:
            return None
        done = self.done.get(file, set())
        out = []
        for a, b in zip(bounds, bounds[1:]):
            crc = table.crc_of(a, b, done, parts)
            if crc is None:
                return None
            out.append((b - a, crc))
        return out

    def forget_parts(self) -> None:
        """Drop the kept parts (once their ranges have been asked for)."""
        self._parts.clear()

    def covers(self, read: Read) -> bool:
        return read.file in self.tables

    def read(self, reads: list[Read]) -> dict[int, torch.Tensor]:
        """Read id -> uint8 tensor of exactly ``[begin, end)`` (verified)."""
        out: dict[int, torch.Tensor] = {}
        spans: list[tuple[str, int, int, list[Read]]] = []
        for r in sorted(reads, key=lambda r: (_file(r), r.begin)):
            lo, hi = self.tables[_file(r)].widen(r.begin, r.end)
            if (
                spans
                and spans[-1][0] == r.file
                and lo <= spans[-1][2]
                and max(hi, spans[-1][2]) - spans[-1][1] <= MAX_SPAN
            ):
                f, a, b, rs = spans[-1]
                spans[-1] = (f, a, max(b, hi), [*rs, r])
            else:
                spans.append((_file(r), lo, hi, [r]))
        cuts = {f: sorted(c) for f, c in self._cuts.items()}
        self._cuts.clear()
        for name, lo, hi, rs in spans:
            view = self.storage.read_view(name, lo, hi)
            cut = cuts.get(name, ())
            parts = self._parts.setdefault(name, {}) if cut else None
            newly = self.tables[name].check(lo, view, self.done.setdefault(name, set()), cut, parts)
            self.bytes_checked += newly
            self.bytes_fetched += newly if self.mapped else hi - lo
            whole = as_bytes(view)
            for r in rs:
                out[r.id] = whole[r.begin - lo : r.end - lo]
        return out


def band_view(read: Read, buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if read.encoding == "raw":
        if buf.storage_offset() % dtype.itemsize:
            buf = buf.clone()  # safetensors does not align tensors inside its data section
        return buf.view(dtype).reshape(read.box.sizes)
    from reshard_svc.format.readers.dcp import decode_torch_save

    t = decode_torch_save(buf.numpy().tobytes(), f"{read.file}@{read.begin}")
    _, _, picks = read.encoding.partition("@")
    if picks:  # one layer (one expert) of a stacked item (--split-layers)
        index = tuple(int(p) for p in picks.split(","))
        if len(index) > t.dim() or any(not 0 <= i < n for i, n in zip(index, t.shape)):
            raise CorruptCheckpointError(
                f"{read.file}@{read.begin}: item of {read.tensor!r} has shape {list(t.shape)}, "
                f"which has no slice {list(index)}"
            )
        t = t[index]
    if tuple(t.shape) != read.box.sizes:
        raise CorruptCheckpointError(
            f"{read.file}@{read.begin}: item of {read.tensor!r} has shape {list(t.shape)}, "
            f"the metadata says {list(read.box.sizes)}"
        )
    return t.to(dtype).contiguous()


class StorageSource:
    """One rank's reads of each wave from a checkpoint's files, each the cheapest safe way.

    * **in place**: a read that is exactly one piece of this rank, landing in a few long
      runs of a local destination, is read straight into it (``preadv``);
    * **mapped and checked**: any other read of a file with a block table goes through
      :class:`CheckedReader`;
    * **buffered**: the rest (no block table, or object stores) is read into fresh buffers.

    Reads of files with a block table are widened to whole blocks and checked before any
    byte is used; a mismatch raises :class:`~reshard_svc.errors.ChecksumError`.
    ``check_in_place`` lets a checked read land in its destination first (``convert``
    turns it off: it writes verified memory-mapped source bytes straight to its files).

    The in-place reads of a wave are this rank's reading pool: with ``io_threads`` above
    one, each file's reads go to a thread of their own (``reshard-read``), which reads
    them in file order and checks every block it read (neighbours in a file still share
    their edge blocks); the first error is raised once every thread has stopped.
    """

    def __init__(
        self,
        storage: Storage,
        dtypes: Mapping[str, torch.dtype],
        rank: int,
        tables: Mapping[str, BlockTable],
        check_in_place: bool = True,
        io_threads: int = 1,
    ) -> None:
        self.storage = storage
        self.dtypes = dtypes
        self.rank = rank
        self.local = storage.local_files
        self.checked = CheckedReader(storage, tables, mapped=self.local)
        self.check_in_place = check_in_place
        self.io_threads = max(1, io_threads)
        self._plain = 0  # bytes read from files without a block table
        self._count = threading.Lock()  # the byte counters, from the reading threads
        self._edges = threading.local()  # each thread's edge-block buffer

    def dtype(self, tensor: str) -> torch.dtype:
        return self.dtypes[tensor]

    @property
    def bytes_read(self) -> int:
        return self._plain + self.checked.bytes_fetched

    def read(
        self, mine: Sequence[Read], pieces: Mapping[int, list[Piece]], dest: Destination
    ) -> tuple[list[torch.Tensor], set[Piece]]:
        """This rank's reads of one wave, in order, as tensors of each read's box; and the
        pieces read straight into ``dest``."""
        out: dict[int, torch.Tensor] = {}
        buffered, verified = [], []
        landed: set[Piece] = set()
        in_place: list[tuple[Read, tuple[Piece, torch.Tensor, list[Any]]]] = []
        for r in sorted(mine, key=lambda r: (r.file or "", r.begin)):
            target = self._in_place_target(r, pieces.get(r.id, ()), dest) if self.local else None
            if target is not None:
                in_place.append((r, target))
            elif self.checked.covers(r):
                verified.append(r)
            else:
                buffered.append(r)
        # In-place reads first, in file order, so neighbours share their edge blocks; the
        # mapped reads then skip the blocks those checked.
        for rid, view in self._read_files_in_place(in_place):
            out[rid] = view
        landed.update(target[0] for _, target in in_place)
        by_id = {r.id: r for r in verified}
        slabs = self._cut_for_slabs(verified, pieces, dest)
        for rid, raw in (self.checked.read(verified) if verified else {}).items():
            out[rid] = band_view(by_id[rid], raw, self.dtypes[by_id[rid].tensor])
        if slabs:
            self._hand_over_crcs(slabs, dest)
        bufs = read_bands(self.storage, [(_file(r), r.begin, r.end) for r in buffered])
        for r, b in zip(buffered, bufs):
            out[r.id] = band_view(r, b, self.dtypes[r.tensor])
            self._plain += r.nbytes
        return [out[r.id] for r in mine], landed

    def _cut_for_slabs(
        self, verified: Sequence[Read], pieces: Mapping[int, list[Piece]], dest: Destination
    ) -> list[tuple[Piece, str, list[int]]]:
        """Where a destination writes pieces of these reads to files unchanged, straight
        from their bytes (``dest.slab_output``: ``convert``), cut the source blocks at the
        pieces' ends and at the output blocks' bounds, so the check's own pass sums each
        output block's share (one pass per byte). The pieces, their files and cuts."""
        slab_output = getattr(dest, "slab_output", None)
        if slab_output is None:
            return []
        out = []
        for r in verified:
            if r.encoding != "raw":
                continue
            for p in pieces.get(r.id, ()):
                if p.dest != self.rank or not p.box.ndim or p.box.sizes[1:] != r.box.sizes[1:]:
                    continue  # not this rank's, or not contiguous in the source
                where = slab_output(p, self.dtypes[r.tensor])
                if where is None:
                    continue
                offset, block = where
                isz = self.dtypes[r.tensor].itemsize
                row = math.prod(r.box.sizes[1:]) * isz
                a = r.begin + (p.box.offsets[0] - r.box.offsets[0]) * row
                n = p.box.numel * isz
                first = (offset // block + 1) * block
                bounds = [a, *(a + k - offset for k in range(first, offset + n, block)), a + n]
                self.checked.cut(_file(r), bounds)
                out.append((p, _file(r), bounds))
        return out

    def _hand_over_crcs(self, slabs: list[tuple[Piece, str, list[int]]], dest: Destination) -> None:
        known = getattr(dest, "known_crcs", None)
        for p, file, bounds in slabs:
            crcs = self.checked.crcs(file, bounds)
            if crcs is not None and known is not None:
                known[p] = crcs
        self.checked.forget_parts()

    def _read_files_in_place(
        self, reads: list[tuple[Read, tuple[Piece, torch.Tensor, list[Any]]]]
    ) -> list[tuple[int, torch.Tensor]]:
        """Each in-place read's id and view: one file's reads after another in file order,
        the files spread over the reading pool's threads; reads into device tensors cut into
        slot-sized runs of whole blocks, each run on any thread (through the pinned ring)."""
        by_file: dict[str, list[tuple[Read, tuple[Piece, torch.Tensor, list[Any]]]]] = {}
        on_device: list[tuple[Read, torch.Tensor]] = []
        for r, target in reads:
            if _through_ring(target[1]):
                on_device.append((r, target[1]))
            else:
                by_file.setdefault(_file(r), []).append((r, target))

        def one_file(group: list[tuple[Read, tuple[Piece, torch.Tensor, list[Any]]]]) -> Any:
            return [(r.id, self._read_in_place(r, *target)) for r, target in group]

        groups = list(by_file.values())
        tasks: list[tuple[Any, ...]] = [(one_file, g) for g in groups]
        with pinned_ring().session() if on_device else contextlib.nullcontext() as ring:
            for r, view in on_device:
                flat = view.reshape(-1).view(torch.uint8)
                tasks += [
                    (self._read_to_device, ring, r, flat, a, b)
                    for a, b in self._chunks(r, pinned_ring().slot_bytes)
                ]
            done = self._on_pool(tasks, len(tasks))
        landed = [x for group in done[: len(groups)] for x in group]
        return landed + [(r.id, view) for r, view in on_device]

    def _on_pool(self, tasks: list[tuple[Any, ...]], width: int) -> list[Any]:
        """Each ``fn(*args)`` of ``tasks`` on the reading pool (here when one thread does),
        their results in order; the first error raised once every thread has stopped."""
        threads = min(self.io_threads, width)
        if threads <= 1:
            return [fn(*args) for fn, *args in tasks]
        with ThreadPoolExecutor(threads, thread_name_prefix="reshard-read") as pool:
            futures = [pool.submit(fn, *args) for fn, *args in tasks]
            wait(futures)  # every thread stops before an error is raised
            return [f.result() for f in futures]

    def _chunks(self, r: Read, slot_bytes: int) -> list[tuple[int, int]]:
        """``r``'s bytes widened to whole blocks, in runs of whole blocks that fit a slot."""
        table = self.checked.tables[_file(r)]
        bs = table.block_size
        step = slot_bytes - slot_bytes % bs
        begin, end = table.widen(r.begin, r.end)
        return [(a, min(end, a + step)) for a in range(begin, end, step)]

    def _read_to_device(
        self, ring: PinnedRing, r: Read, flat: torch.Tensor, a: int, b: int
    ) -> None:
        """File bytes ``[a, b)`` (whole blocks) into a slot of the ring, each block checked
        there, then the part inside ``r`` copied to its place in ``flat`` (the destination's
        bytes, on the device)."""
        file = _file(r)
        table = self.checked.tables[file]
        slot = ring.take()
        try:
            data = tensor_bytes(slot.buf[: b - a])
            with self.storage.positional(file) as readv:
                readv(a, [data])
            checked = table.check(a, data)
            lo, hi = max(a, r.begin), min(b, r.end)
            if hi > lo:
                ring.to_device(slot, lo - a, flat[lo - r.begin : hi - r.begin])
        finally:
            slot.release()
        with self._count:
            self.checked.bytes_checked += checked
            self.checked.bytes_fetched += checked

    def _in_place_target(
        self, r: Read, parts: Sequence[Piece], dest: Destination
    ) -> tuple[Piece, torch.Tensor, list[Any]] | None:
        """(part, destination view, its memory runs) when ``r`` can be read straight into
        its destination: it is exactly one part of this rank, landing in few long runs."""
        if r.encoding != "raw":
            return None
        table = self.checked.tables.get(_file(r))
        if table is not None and (not self.check_in_place or r.nbytes < 2 * table.block_size):
            return None  # small checked reads coalesce better when mapped
        own = [p for p in parts if p.dest == self.rank and p.box == r.box]
        if not own:
            return None
        view = dest.view(own[0])
        if view is None or view.dtype != self.dtypes[r.tensor]:
            return None
        if _through_ring(view):  # device memory: through the pinned ring, checked on the pool
            ok = (
                table is not None
                and view.is_contiguous()
                and pinned_ring().slot_bytes >= table.block_size
            )
            return (own[0], view, []) if ok else None
        runs = tensor_runs(view)
        if runs is None:
            return None
        if table is not None and len(runs) > 2 + r.nbytes // MIN_CHECKED_RUN:
            return None  # short rows: checking row by row costs more than map and copy
        return own[0], view, runs

    def _read_in_place(
        self, r: Read, part: Piece, view: torch.Tensor, runs: list[Any]
    ) -> torch.Tensor:
        """Read ``r`` straight into its destination (``preadv``).

        With a block table, every block the read touches is checked: the bytes are read
        in cache-sized pieces, each checked right after it lands. A block the read starts
        or ends inside is completed from the file into a small buffer (unless a
        neighbouring read checked it already), so it is checked in the same pass. A
        mismatch raises before any wave hook or caller sees the bytes.
        """
        file = _file(r)
        table = self.checked.tables.get(file)
        if table is None:
            with self.storage.positional(file) as readv:
                readv(r.begin, runs)
            with self._count:
                self._plain += r.nbytes
            return view
        done = self.checked.done.setdefault(file, set())
        bs = table.block_size
        head = r.begin - r.begin % bs if r.begin // bs not in done else r.begin
        tail = r.end
        if r.end % bs and r.end != table.size and r.end // bs not in done:
            tail = min(table.size, (r.end // bs + 1) * bs)
        stream = table.stream(head, done)
        with self.storage.positional(file) as readv:
            if head < r.begin:
                stream.update(self._edge(readv, head, r.begin))
            _land_checked(readv, stream, r.begin, runs)
            if tail > r.end:
                stream.update(self._edge(readv, r.end, tail))
        newly = stream.close()
        with self._count:
            self.checked.bytes_checked += newly
            self.checked.bytes_fetched += newly  # local: each block read once, wholly
        return view

    def _edge(self, readv: Any, begin: int, end: int) -> memoryview:
        """Bytes ``[begin, end)`` (the rest of an edge block) in this thread's reused
        buffer."""
        edge: bytearray | None = getattr(self._edges, "buf", None)
        if edge is None or len(edge) < end - begin:
            edge = self._edges.buf = bytearray(end - begin)
        buf = memoryview(edge)[: end - begin]
        readv(begin, [buf])
        return buf


def _file(r: Read) -> str:
    if r.file is None:
        raise ValueError(f"read {r.id} of {r.tensor!r} has no file")  # a bug, not bad input
    return r.file


def _land_checked(readv: Any, stream: BlockStream, start: int, runs: list[Any]) -> None:
    """``preadv`` consecutive bytes from ``start`` into ``runs`` about :data:`CHUNK` at a
    time, checking each batch as soon as it lands."""
    pos, size, batch = start, 0, list[memoryview]()

    def flush() -> None:
        readv(pos, batch)
        for p in batch:
            stream.update(p)

    for run in runs:
        view = memoryview(run).cast("B")
        for off in range(0, view.nbytes, CHUNK):
            batch.append(view[off : off + CHUNK])
            size += batch[-1].nbytes
            if size >= CHUNK:
                flush()
                pos, size, batch = pos + size, 0, []
    if batch:
        flush()


def _through_ring(view: torch.Tensor) -> bool:
    """Whether a destination is filled through the pinned ring (it is not on the CPU)."""
    return view.device.type != "cpu"
