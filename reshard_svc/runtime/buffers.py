"""Zero-copy helpers: tensor memory as I/O buffers, and a background hash+write pipeline.

``tensor_runs`` exposes a CPU tensor view (contiguous or strided) as the list of its
contiguous memory runs, in row-major element order, so ``preadv`` can read stored bytes
straight into place. ``BackgroundWriter`` checksums and writes buffers on helper threads
(CRC32C, hashlib and file writes release the GIL), in submission order, with a cap on
queued bytes so memory stays bounded. ``BufferPool`` recycles staging buffers;
``Arena`` hands out the same memory again each time a plan runs.

Who owns a buffer that crosses a thread, a forked child or a process group is written
where it is handed over, and summed up in ``docs/code.md`` ("Who owns what"). With
``RESHARD_DEBUG_BUFFERS=1`` every buffer that is pooled or handed over is poisoned when
its owner releases it (:func:`release`) and checked when it is taken again
(:func:`reclaim`): a late write raises :class:`~reshard_svc.errors.BufferReuseError`
naming the buffer, and a late read sees the pattern (a CRC32C failure), never silence.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from reshard_svc.errors import BufferReuseError
from reshard_svc.format.checksums import HashingWriter
from reshard_svc.jobs.environment import DEBUG_BUFFERS_ENV

__all__ = [
    "ALIGN",
    "Arena",
    "BackgroundWriter",
    "BufferPool",
    "POISON",
    "aligned",
    "debug_buffers",
    "reclaim",
    "release",
    "tensor_bytes",
    "tensor_runs",
]

#: Pieces packed into exchange buffers, and views an :class:`Arena` hands out, start at
#: multiples of this, so a byte view can be viewed as any dtype in place.
ALIGN = 16
MAX_RUNS = 16384


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


#: The byte a released buffer is filled with under ``RESHARD_DEBUG_BUFFERS=1``.
POISON = 0xDB


def debug_buffers() -> bool:
    """Whether released buffers are poisoned and checked (``RESHARD_DEBUG_BUFFERS=1``)."""
    return os.environ.get(DEBUG_BUFFERS_ENV, "0") not in ("", "0")


def _raw(buf: Any) -> torch.Tensor:
    if isinstance(buf, torch.Tensor):
        flat = buf.detach().reshape(-1) if buf.is_contiguous() else None
        if flat is None:
            raise ValueError("only contiguous buffers are pooled or handed over")
        return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    view = memoryview(buf).cast("B")
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def release(buf: Any, name: str) -> None:
    """The owner of ``buf`` (a contiguous tensor, ``bytearray`` or writable buffer) gives
    it up: nobody may touch it until it is taken again. Under ``RESHARD_DEBUG_BUFFERS=1``
    it is overwritten with :data:`POISON` (``name`` is for the error :func:`reclaim`
    raises)."""
    if debug_buffers():
        _raw(buf).fill_(POISON)


def reclaim(buf: Any, name: str) -> None:
    """``buf`` is taken again after :func:`release`. Under ``RESHARD_DEBUG_BUFFERS=1``,
    raise :class:`~reshard_svc.errors.BufferReuseError` naming it when anyone wrote to it
    in between."""
    if not debug_buffers():
        return
    raw = _raw(buf)
    bad = torch.nonzero(raw != POISON)
    if bad.numel():
        first = int(bad[0, 0])
        raise BufferReuseError(
            f"{name}: {bad.shape[0]} of {raw.numel()} bytes were written after it was "
            f"released (the first at offset {first}): a use after release (a bug in "
            f"reshard_svc; {DEBUG_BUFFERS_ENV}=1 found it)",
            buffer=name,
        )


#: Bytes checksummed and then written at a time by a write thread (fits in L2).
FUSED_PIECE = 1024 * 1024


def tensor_runs(view: torch.Tensor) -> list[Any] | None:
    """Writable byte views of ``view``'s contiguous runs in element order, or None when
    the view is not on the CPU or splits into more than ``MAX_RUNS`` runs."""
    if view.device.type != "cpu":
        return None
    if view.numel() == 0:
        return []
    shape, strides = list(view.shape), list(view.stride())
    k, expected = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expected):
        expected *= shape[k - 1]
        k -= 1
    outer = shape[:k]
    if math.prod(outer) > MAX_RUNS:
        return None
    esz = view.element_size()
    run_bytes = math.prod(shape[k:]) * esz
    base = view.data_ptr()
    if k == 1 and strides[0] > 0:
        # The common case (rows of a wider tensor): numpy strides, C-speed iteration.
        n, step = shape[0], strides[0] * esz
        span = (n - 1) * step + run_bytes
        raw = (ctypes.c_char * span).from_address(base)
        flat = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]
        rows = np.lib.stride_tricks.as_strided(flat, (n, run_bytes), (step, 1), writeable=True)
        return list(rows)  # type: ignore[arg-type]
    offsets = [0]
    for size, stride in zip(outer, strides[:k]):
        offsets = [o + i * stride * esz for o in offsets for i in range(size)]
    # One buffer over the whole span, sliced per run: slicing a memoryview is cheap.
    lo = min(offsets)
    span = max(offsets) + run_bytes - lo
    whole = memoryview((ctypes.c_char * span).from_address(base + lo)).cast("B")
    return [whole[off - lo : off - lo + run_bytes] for off in offsets]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


class BufferPool:
    """Reusable CPU staging buffers, so steady-state waves never touch fresh memory.

    First-touching fresh pages costs more than the copy that fills them (1.4-2.5 GB/s on a
    2-core VM, huge pages or not, against 12 GB/s for memcpy into touched memory), so
    released buffers are kept, up to ``max_bytes``, and handed out again by size.
    ``take`` and ``give`` may be called from different threads. A buffer given back is
    the pool's until taken again (:func:`release`, :func:`reclaim`).
    """

    NAME = "a pooled staging buffer"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            stack = self._free.get(nbytes)
            buf = stack.pop() if stack else None
            if buf is not None:
                self._kept -= nbytes
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        else:
            reclaim(buf, self.NAME)
        return buf.view(dtype).view(shape)

    def give(self, t: torch.Tensor) -> None:
        raw = t.view(-1).view(torch.uint8) if t.numel() else t.view(torch.uint8)
        n = raw.numel()
        if not n:
            return
        with self._lock:
            if self._kept + n > self.max_bytes:
                return
            self._kept += n
        release(raw, self.NAME)
        with self._lock:
            self._free.setdefault(n, []).append(raw)


class Arena:
    """Byte buffers reused each time a plan runs: ``take`` hands out aligned views of
    a few slabs, in order; ``reset`` starts over at the first slab. A plan run again makes
    the same takes, so it gets the same memory and faults in no new pages (a cached
    transfer plan keeps its arena). A slab too small for a take at its start is replaced.

    Ownership: the views a run took are its own until ``reset``, which releases them all
    (:func:`release`); a view from before ``reset`` must be dropped first (under
    ``RESHARD_DEBUG_BUFFERS=1``, a write through one fails the next ``take`` of that
    memory).
    """

    SLAB = 16 * 1024 * 1024

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        slab: int = SLAB,
        align: int = ALIGN,
        name: str = "an exchange arena's buffer",
    ) -> None:
        self.device = torch.device(device)
        self.slab, self.align, self.name = slab, align, name
        self._slabs: list[torch.Tensor] = []
        self._used: list[int] = []  # bytes of each slab taken since the last reset
        self._poisoned: list[int] = []  # of each slab, the prefix released (debug only)
        self._at = (0, 0)  # (slab, offset) of the next take

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._slabs)

    def reset(self) -> None:
        if debug_buffers():
            for i, used in enumerate(self._used):
                release(self._slabs[i][:used], self.name)
                self._poisoned[i] = max(self._poisoned[i], used)
        self._used = [0] * len(self._slabs)
        self._at = (0, 0)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` bytes (at a multiple of the arena's alignment)."""
        need = -(-nbytes // self.align) * self.align
        slab, off = self._at
        if slab < len(self._slabs) and off + need > self._slabs[slab].numel() and off:
            slab, off = slab + 1, 0
        if slab == len(self._slabs):
            self._slabs.append(
                torch.empty(max(need, self.slab), dtype=torch.uint8, device=self.device)
            )
            self._used.append(0)
            self._poisoned.append(0)
        elif off + need > self._slabs[slab].numel():  # too small even from its start
            self._slabs[slab] = torch.empty(0, dtype=torch.uint8)  # free it first
            self._slabs[slab] = torch.empty(need, dtype=torch.uint8, device=self.device)
            self._poisoned[slab] = 0
        if off < self._poisoned[slab]:
            reclaim(self._slabs[slab][off : min(off + need, self._poisoned[slab])], self.name)
        self._at = (slab, off + need)
        self._used[slab] = off + need
        return self._slabs[slab][off : off + nbytes]

    def take_like(self, like: torch.Tensor) -> torch.Tensor:
        """A view shaped and typed like ``like`` (contiguous)."""
        return self.take(like.numel() * like.element_size()).view(like.dtype).view(like.shape)


class BackgroundWriter:
    """Checksum and write buffers on helper threads; at most ``max_bytes`` queued.

    Each output stream gets its own write thread (up to ``max_streams``, then shared), so
    several files are written at once while order within a file is kept. The block
    CRC32Cs are computed on that thread just before each write, on bytes still hot in
    cache (CRC32C runs several times faster than the write itself, and a separate thread
    would only contend for the same cores); a sha256, slower than the write, gets a
    thread of its own.
    """

    def __init__(self, max_bytes: int, max_streams: int = 4) -> None:
        self.max_bytes = max(1, max_bytes)
        self.max_streams = max_streams
        self._lanes: dict[int, ThreadPoolExecutor] = {}
        self._pool: list[ThreadPoolExecutor] = []
        self._hashers: dict[int, ThreadPoolExecutor] = {}
        self._queue: deque[tuple[Future[Any] | None, Future[Any], int]] = deque()
        self._queued = 0

    def _lane(self, out: HashingWriter) -> ThreadPoolExecutor:
        lane = self._lanes.get(id(out))
        if lane is None:
            if len(self._pool) < self.max_streams:
                lane = ThreadPoolExecutor(1, thread_name_prefix="reshard-write")
                self._pool.append(lane)
            else:
                lane = self._pool[len(self._lanes) % self.max_streams]
            self._lanes[id(out)] = lane
        return lane

    def _hasher(self, out: HashingWriter) -> ThreadPoolExecutor | None:
        if out.sums.algorithm != "sha256":
            return None
        hasher = self._hashers.get(id(out))
        if hasher is None:
            hasher = self._hashers[id(out)] = ThreadPoolExecutor(
                1, thread_name_prefix="reshard-hash"
            )
        return hasher

    def submit(
        self,
        out: HashingWriter,
        data: memoryview,
        keep: Any = None,
        done: Callable[[], None] | None = None,
        crcs: list[tuple[int, int]] | None = None,
    ) -> None:
        """Queue ``data`` for ``out``; ``keep`` is held until the write is done, then
        ``done()`` runs (on the write thread, after the checksum is computed too).
        ``crcs``: the bytes' (length, CRC32C) per block of ``out``, already summed (see
        :meth:`~reshard_svc.format.checksums.FileChecksummer.take_known`)."""
        n = data.nbytes
        while self._queue and self._queued + n > self.max_bytes:
            self._pop()
        hasher = self._hasher(out)
        h = hasher.submit(out.sums.update, data) if hasher is not None else None
        w = self._lane(out).submit(_write_raw, out, data, keep, h, done, crcs)
        self._queue.append((h, w, n))
        self._queued += n

    def submit_band(
        self, out: HashingWriter, shape: tuple[int, int], pieces: list[tuple[Any, torch.Tensor]]
    ) -> None:
        """Queue a 2-D band given as ``pieces`` ((offsets, sizes) relative to the band, and
        a strided view each: column splits of rows that sit in a verified source map or a
        receive buffer). The write thread gathers about :data:`FUSED_PIECE` bytes of rows
        at a time into a small reused buffer, checksums and writes them while they are in
        cache: no band-sized staging copy, each byte read from memory once."""
        dtype = pieces[0][1].dtype
        n = shape[0] * shape[1] * dtype.itemsize
        if out.sums.algorithm == "sha256":  # its hash runs on another thread, in order
            whole = _gather(shape, pieces, torch.empty(shape, dtype=dtype))
            return self.submit(out, tensor_bytes(whole), keep=whole)
        while self._queue and self._queued + n > self.max_bytes:
            self._pop()
        w = self._lane(out).submit(_write_band, out, shape, pieces)
        self._queue.append((None, w, n))
        self._queued += n

    def _pop(self) -> None:
        h, w, n = self._queue.popleft()
        self._queued -= n
        if h is not None:
            h.result()
        w.result()

    def drain(self) -> None:
        """Wait for everything queued; re-raises the first failure."""
        while self._queue:
            self._pop()

    def _shutdown(self) -> None:
        for ex in [*self._pool, *self._hashers.values()]:
            ex.shutdown(wait=True)
        self._pool.clear()
        self._lanes.clear()
        self._hashers.clear()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._shutdown()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self._queue.clear()
            self._shutdown()
        else:
            self.close()


_scratch = threading.local()


def _gather(
    shape: tuple[int, int],
    pieces: list[tuple[Any, torch.Tensor]],
    into: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """Rows ``[first, first + len(into))`` of the band, from its pieces, into ``into``."""
    rows = into.shape[0]
    for (offsets, sizes), data in pieces:
        lo, hi = max(first, offsets[0]), min(first + rows, offsets[0] + sizes[0])
        if hi > lo:
            into[lo - first : hi - first, offsets[1] : offsets[1] + sizes[1]].copy_(
                data[lo - offsets[0] : hi - offsets[0]]
            )
    return into


def _write_band(
    out: HashingWriter, shape: tuple[int, int], pieces: list[tuple[Any, torch.Tensor]]
) -> None:
    dtype = pieces[0][1].dtype
    row = shape[1] * dtype.itemsize
    step = max(1, FUSED_PIECE // max(1, row))
    need = step * row
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _scratch.buf = torch.empty(need, dtype=torch.uint8)
    for first in range(0, shape[0], step):
        rows = min(step, shape[0] - first)
        chunk = buf[: rows * row].view(dtype).view(rows, shape[1])
        _gather(shape, pieces, chunk, first)  # torch copies release the GIL
        out.write(tensor_bytes(buf[: rows * row]))


def _write_pieces(out: HashingWriter, data: memoryview) -> None:
    """``data`` written a piece at a time: one write() of a long mapped range stalls
    (0.13-1.3 s for the same 512 MiB on ext4 here, a steady 0.13 s in 1 MiB pieces)."""
    for off in range(0, data.nbytes, FUSED_PIECE):
        out.raw.write(data[off : off + FUSED_PIECE])


def _write_raw(
    out: HashingWriter,
    data: memoryview,
    keep: Any,
    hashed: Future[Any] | None,
    done: Callable[[], None] | None,
    crcs: list[tuple[int, int]] | None = None,
) -> None:
    """Write ``data`` (summed on the way unless ``hashed`` or ``crcs`` did), then run
    ``done()``; on an error too, once no thread reads ``data`` any more (a ring slot or a
    pooled buffer is never lost to a failed write)."""
    try:
        _write_summed(out, data, hashed, crcs)
    except BaseException:
        if done is not None:
            if hashed is not None:
                with contextlib.suppress(BaseException):
                    hashed.result()
            done()
        raise
    if done is not None:
        if hashed is not None:
            hashed.result()  # the buffer is free only once both threads are past it
        done()


def _write_summed(
    out: HashingWriter,
    data: memoryview,
    hashed: Future[Any] | None,
    crcs: list[tuple[int, int]] | None,
) -> None:
    if (
        hashed is None
        and crcs is not None
        and sum(n for n, _ in crcs) == data.nbytes
        and out.sums.take_known(crcs)
    ):
        # its block CRCs came from the source's check: no second sum
        _write_pieces(out, data)
    elif hashed is None:
        # Checksum and write a cache-sized piece at a time: the write reads bytes the
        # CRC just brought into cache instead of fetching them from memory again.
        n = data.nbytes
        for off in range(0, n, FUSED_PIECE):
            piece = data[off : off + FUSED_PIECE]
            out.sums.update(piece)
            out.raw.write(piece)
    else:
        _write_pieces(out, data)
    out.size += data.nbytes
