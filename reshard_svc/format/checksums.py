"""Checksums of data files: CRC32C per fixed-size block (format v2), optional sha256.

Every data file of a v2 checkpoint carries a CRC32C of each ``block_size`` block (the last
one may be short) and a whole-file value: the CRC32C of the block table itself (each block's
CRC as 4 big-endian bytes, in order — S3's "composite" checksum construction). The index
stores the table as one hex string per file, 8 characters per block: 8 MB for a 1 TB
checkpoint at the default 1 MiB blocks (0.0008 %).

Readers check every block they read before the bytes are used (:meth:`BlockTable.check`);
a ranged read is widened to block bounds (:meth:`BlockTable.widen`), so the over-read is
at most one block at each end of a read.

CRC32C comes from the ``crc32c`` package (SSE4.2 / ARMv8 instructions, GIL released);
combining two CRCs (CRC(A‖B) from CRC(A), CRC(B) and ``|B|``) from ``anycrc``.

One pass per byte: a reader that checks a block can be asked to cut it at given offsets
(``cuts``) and keep each part's CRC (combined, they must give the block's); a writer whose
bytes are such parts, unchanged, builds its own block CRCs by combining them
(:meth:`FileChecksummer.take_known`) instead of reading the bytes again.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import anycrc as _anycrc
import crc32c as _crc32c

from reshard_svc.errors import ChecksumError, CorruptCheckpointError, UsageError

__all__ = [
    "ALGORITHMS",
    "DEFAULT_BLOCK_SIZE",
    "BlockStream",
    "BlockTable",
    "FileChecksummer",
    "HashingWriter",
    "check_algorithm",
    "crc32c",
    "crc32c_combine",
]

#: ``crc32c`` (default): block CRCs, checked on every read. ``sha256``: the same block CRCs
#: plus a whole-file sha256 (checked by ``verify``). ``none``: no checksums at all.
ALGORITHMS = ("crc32c", "sha256", "none")
DEFAULT_BLOCK_SIZE = 1024 * 1024
MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = 1 << 30


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


_CRC32C = _anycrc.Model("CRC32C")


def crc32c_combine(first: int, second: int, second_len: int) -> int:
    """CRC32C of ``A‖B`` from ``first`` = CRC32C(A), ``second`` = CRC32C(B) and ``|B|``."""
    return int(_CRC32C.combine(first, second, second_len))


#: A part of a checked block: file offset -> (end, CRC32C of [offset, end)).
Parts = dict[int, tuple[int, int]]


def check_algorithm(checksum: Any) -> str:
    """Validate a ``checksum=`` argument (``True``/``False`` kept for older callers)."""
    if checksum is True:
        return "crc32c"
    if checksum is False or checksum is None:
        return "none"
    if not isinstance(checksum, str) or checksum.lower() not in ALGORITHMS:
        raise UsageError(f"checksum must be one of {', '.join(ALGORITHMS)}, got {checksum!r}")
    return checksum.lower()


def check_block_size(value: Any, where: str) -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not MIN_BLOCK_SIZE <= value <= MAX_BLOCK_SIZE
        or value % MIN_BLOCK_SIZE
    ):
        raise CorruptCheckpointError(
            f"{where}: block_size {value!r} must be a multiple of {MIN_BLOCK_SIZE} between "
            f"{MIN_BLOCK_SIZE} and {MAX_BLOCK_SIZE}"
        )
    return value


def composite(crcs: Sequence[int]) -> int:
    """The whole-file value: CRC32C of the block CRCs as big-endian u32s."""
    return crc32c(struct.pack(f">{len(crcs)}I", *crcs))


@dataclass(frozen=True, kw_only=True)
class BlockTable:
    """One file's block CRCs. Built from the index, so it is already validated."""

    file: str
    size: int
    block_size: int
    crcs: tuple[int, ...]

    @classmethod
    def parse(cls, file: str, size: int, block_size: int, text: Any, where: str) -> BlockTable:
        """Parse the hex table; the count must match the file size."""
        if not isinstance(text, str):
            raise CorruptCheckpointError(f"{where}.blocks must be a hex string")
        want = -(-size // block_size)
        if len(text) != 8 * want:
            raise CorruptCheckpointError(
                f"{where}.blocks has {len(text) / 8:g} block CRCs; a {size}-byte file in "
                f"{block_size}-byte blocks has {want}"
            )
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise CorruptCheckpointError(f"{where}.blocks is not hexadecimal") from None
        return cls(
            file=file, size=size, block_size=block_size, crcs=struct.unpack(f">{want}I", raw)
        )

    def to_hex(self) -> str:
        return struct.pack(f">{len(self.crcs)}I", *self.crcs).hex()

    @property
    def composite(self) -> int:
        return composite(self.crcs)

    def widen(self, begin: int, end: int) -> tuple[int, int]:
        """``[begin, end)`` grown to whole blocks (the file end closes the last one)."""
        bs = self.block_size
        return (begin // bs) * bs, min(self.size, -(-end // bs) * bs)

    def check(
        self,
        start: int,
        data: Any,
        done: set[int] | None = None,
        cuts: Sequence[int] = (),
        parts: Parts | None = None,
    ) -> int:
        """Check the whole blocks ``data`` read from ``start`` (block-aligned).

        Blocks listed in ``done`` are skipped; checked ones are added to it. Returns the
        bytes checked. Raises :class:`ChecksumError` on the first mismatch. A block with
        file offsets of ``cuts`` (sorted) inside it is summed part by part, the parts'
        CRCs combined for the check, and each part kept in ``parts``.
        """
        bs = self.block_size
        if start % bs:
            raise ValueError(f"unaligned block check at {start}")  # a bug, not bad input
        view = memoryview(data).cast("B")
        n = view.nbytes
        first = start // bs
        checked = 0
        for i in range(-(-n // bs)):
            if done is not None and first + i in done:
                continue
            block = view[i * bs : (i + 1) * bs]
            lo = start + i * bs
            if lo + block.nbytes != min(self.size, start + (i + 1) * bs):
                raise ValueError("partial block handed to check")
            inside = _inside(cuts, lo, lo + block.nbytes) if cuts else []
            if parts is not None and inside:
                self._compare(first + i, _check_parts(block, lo, inside, parts))
            else:
                self._compare(first + i, crc32c(block))
            checked += block.nbytes
            if done is not None:
                done.add(first + i)
        return checked

    def crc_of(self, begin: int, end: int, done: set[int], parts: Parts) -> int | None:
        """CRC32C of ``[begin, end)`` from checked blocks (their table CRCs) and kept
        parts, combined; None unless such pieces tile the range exactly."""
        bs, crc, pos = self.block_size, 0, begin
        while pos < end:
            block = pos // bs
            stop = min(self.size, (block + 1) * bs)
            if pos == block * bs and stop <= end and block in done:
                got, nxt = self.crcs[block], stop
            else:
                kept = parts.get(pos)
                if kept is None or kept[0] > end:
                    return None
                nxt, got = kept
            crc = crc32c_combine(crc, got, nxt - pos) if pos > begin else got
            pos = nxt
        return crc

    def stream(self, start: int, done: set[int] | None = None) -> BlockStream:
        """A :class:`BlockStream` over this file's bytes from ``start``."""
        return BlockStream(self, start, done)

    def _compare(self, block: int, got: int) -> None:
        want = self.crcs[block]
        if got != want:
            lo = block * self.block_size
            hi = min(self.size, lo + self.block_size)
            raise ChecksumError(
                f"{self.file}: bytes [{lo}, {hi}) (block {block}) fail their CRC32C: expected "
                f"{want:08x}, got {got:08x} — the file is corrupt; restore it from a replica "
                "or re-create the checkpoint",
                file=self.file,
                begin=lo,
                end=hi,
                expected=f"{want:08x}",
                actual=f"{got:08x}",
            )


def _inside(cuts: Sequence[int], lo: int, hi: int) -> list[int]:
    """The offsets of sorted ``cuts`` strictly inside ``(lo, hi)``."""
    return list(cuts[bisect.bisect_right(cuts, lo) : bisect.bisect_left(cuts, hi)])


def _check_parts(block: memoryview, lo: int, inside: list[int], parts: Parts) -> int:
    """The block's CRC32C, summed part by part between the cuts ``inside`` it (each part
    kept in ``parts``), and the parts combined."""
    bounds = [lo, *inside, lo + block.nbytes]
    crc = 0
    for a, b in zip(bounds, bounds[1:]):
        part = crc32c(block[a - lo : b - lo])
        parts[a] = (b, part)
        crc = crc32c_combine(crc, part, b - a) if a > lo else part
    return crc


class FileChecksummer:
    """Block CRCs (and optionally sha256) of a file written front to back.

    ``update`` may be called from one thread at a time with pieces of any size.
    """

    def __init__(self, algorithm: str, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.algorithm = algorithm
        self.block_size = block_size
        self.crcs: list[int] = []
        self._cur = 0
        self._filled = 0
        self._sha: Any = hashlib.sha256() if algorithm == "sha256" else None
        self.size = 0

    def update(self, data: Any) -> None:
        if self.algorithm == "none":
            self.size += memoryview(data).nbytes
            return
        view = memoryview(data).cast("B")
        n = view.nbytes
        self.size += n
        if self._sha is not None:
            self._sha.update(view)
        bs, pos = self.block_size, 0
        while pos < n:
            take = min(bs - self._filled, n - pos)
            self._cur = crc32c(view[pos : pos + take], self._cur)
            self._filled += take
            pos += take
            if self._filled == bs:
                self.crcs.append(self._cur)
                self._cur, self._filled = 0, 0

    def take_known(self, parts: Sequence[tuple[int, int]]) -> bool:
        """Count the next bytes by their parts' CRC32Cs (``(length, crc)`` in order, none
        crossing a block boundary) instead of reading them; False, with nothing counted,
        when the parts do not fit the blocks (the caller sums the bytes instead). Only for
        ``crc32c`` (a sha256 must read the bytes anyway)."""
        if self.algorithm != "crc32c":
            return False
        bs, filled = self.block_size, self._filled
        for n, _ in parts:
            if n <= 0 or filled + n > bs:
                return False
            filled = (filled + n) % bs
        for n, crc in parts:
            self._cur = crc32c_combine(self._cur, crc, n) if self._filled else crc
            self._filled += n
            self.size += n
            if self._filled == bs:
                self.crcs.append(self._cur)
                self._cur, self._filled = 0, 0
        return True

    def result(self) -> dict[str, Any]:
        """The index's checksum fields for this file."""
        if self.algorithm == "none":
            return {}
        crcs = self.crcs + ([self._cur] if self._filled else [])
        out: dict[str, Any] = {
            "crc32c": f"{composite(crcs):08x}",
            "blocks": struct.pack(f">{len(crcs)}I", *crcs).hex(),
        }
        if self._sha is not None:
            out["sha256"] = self._sha.hexdigest()
        return out


class BlockStream:
    """Checks a file's bytes fed in order, piece by piece, as they are read.

    Each block is compared as soon as its last byte arrives, so a reader can check small
    pieces while they are still in cache. The bytes may start or end inside a block only
    if that block is already in ``done`` (checked by an earlier read): its part here is
    skipped. Checked blocks are added to ``done``.
    """

    def __init__(self, table: BlockTable, start: int, done: set[int] | None = None) -> None:
        bs = table.block_size
        if start % bs and (done is None or start // bs not in done):
            raise ValueError(f"unaligned block check at {start}")  # a bug, not bad input
        self.table, self.done = table, done
        self.pos, self.crc, self.checked = start, 0, 0

    def update(self, data: Any) -> None:
        """Feed the next bytes; raises :class:`ChecksumError` when a block they end fails."""
        table, done = self.table, self.done
        bs = table.block_size
        view = memoryview(data).cast("B")
        off, n = 0, view.nbytes
        while off < n:
            block = self.pos // bs
            take = min(n - off, (block + 1) * bs - self.pos)
            fresh = done is None or block not in done
            if fresh:
                self.crc = crc32c(view[off : off + take] if take < n else view, self.crc)
            off += take
            self.pos += take
            if self.pos % bs == 0 or self.pos == table.size:
                if fresh:
                    table._compare(block, self.crc)
                    self.checked += min(table.size, (block + 1) * bs) - block * bs
                    if done is not None:
                        done.add(block)
                self.crc = 0

    def close(self) -> int:
        """The bytes of the blocks this stream checked; the bytes must end on a block
        boundary (or the file's end) unless that block is in ``done``."""
        bs, pos = self.table.block_size, self.pos
        if (
            pos % bs
            and pos != self.table.size
            and (self.done is None or pos // bs not in self.done)
        ):
            raise ValueError("pieces end inside a block")  # a bug, not bad input
        return self.checked


#: :class:`HashingWriter` checksums and writes large buffers in pieces of this size.
WRITE_PIECE = 1024 * 1024


class HashingWriter:
    """Wraps a binary stream written front to back; counts bytes and checksums them
    (block CRC32C, plus sha256 when ``algorithm="sha256"``; nothing for ``"none"``)."""

    def __init__(
        self, raw: IO[bytes], algorithm: str = "crc32c", block_size: int = DEFAULT_BLOCK_SIZE
    ) -> None:
        self.raw = raw
        self.sums = FileChecksummer(algorithm, block_size)
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        """Checksum and write ``data`` a piece at a time, so the write copies each piece
        while the checksum pass has it in cache (one read from memory, not two)."""
        view = memoryview(data).cast("B")
        n = view.nbytes
        for off in range(0, max(n, 1), WRITE_PIECE):
            piece = view[off : off + WRITE_PIECE]
            self.sums.update(piece)
            self.raw.write(piece)
        self.size += n
        return n

    def result(self) -> dict[str, Any]:
        """The index fields of this file's checksums."""
        return self.sums.result()
