"""Where converted bytes go: bands gather per wave (:class:`BandSink`) and stream into
their output files in offset order (:class:`FileWriter`); opaque items are copied
verbatim (:func:`copy_blobs`)."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from reshard_svc.errors import CheckpointError
from reshard_svc.format.checksums import DEFAULT_BLOCK_SIZE, HashingWriter
from reshard_svc.format.hf import MODEL_FILES
from reshard_svc.format.index import Blob, CheckpointIndex, FileMeta
from reshard_svc.layout import Box
from reshard_svc.plan.items import Piece, Wave
from reshard_svc.plan.read import ReadPlan
from reshard_svc.plan.save import FileSpec
from reshard_svc.runtime.buffers import BackgroundWriter, BufferPool, tensor_bytes
from reshard_svc.storage import Storage

__all__ = ["BandSink", "FileWriter", "Transform", "copy_blobs", "copy_model_files"]

#: What a band becomes before it is written: (its target box, its staged data) -> data
Transform = Callable[[Box, torch.Tensor], torch.Tensor]

logger = logging.getLogger(__name__)


def copy_blobs(
    index: CheckpointIndex, src: Storage, staging: Storage, name: str, algorithm: str
) -> tuple[FileMeta, dict[str, Blob]]:
    """Copy every opaque item of ``index`` verbatim into one file ``name`` of ``staging``
    (block CRCs checked on the way in where the source has them; never deserialized)."""
    tables = index.block_tables()
    out: dict[str, Blob] = {}
    with staging.open_write(name) as raw:
        writer = HashingWriter(raw, algorithm, DEFAULT_BLOCK_SIZE)
        for key in sorted(index.blobs):
            b = index.blobs[key]
            table = tables.get(b.file)
            lo, hi = table.widen(b.begin, b.end) if table else (b.begin, b.end)
            data = src.read_view(b.file, lo, hi)
            if table:
                table.check(lo, data)
            start = writer.size
            writer.write(data[b.begin - lo : b.end - lo])
            out[key] = Blob(
                name=key, file=name, begin=start, end=writer.size, encoding=b.encoding, key=b.key
            )
    block_size = DEFAULT_BLOCK_SIZE if algorithm != "none" else None
    return FileMeta.from_written(name, writer.size, writer.result(), block_size), out


def copy_model_files(src: Storage, target: Storage, staging: Storage) -> list[str]:
    """Copy the source folder's config and tokenizer files (:data:`MODEL_FILES`) into an
    HF export's staging area, except those the target folder already has (they stay)."""
    have = set(src.listdir())
    there = set(target.listdir())
    copied = []
    for name in MODEL_FILES:
        if name in have and name not in there:
            staging.write(name, src.read(name))
            copied.append(name)
    if copied:
        logger.info("copied %s from the source", ", ".join(copied))
    return copied


class BandSink:
    """Where a worker's target bands gather during a wave, and how they reach their files.

    Pieces are kept where they arrived (a verified memory map of the source, or a receive
    buffer), never assembled in a band-sized buffer: a band of whole-width row slabs is
    written slab by slab; a 2-D band split by columns (a ``Shard(1)`` target) is gathered
    a cache-sized run of rows at a time on the write thread, checksummed and written
    while in cache. Only a piece that needs a cast, or a band of more dims split inside
    its rows, lands in a pooled buffer (``view``) that goes back once written.

    ``transforms`` (tensor -> (staging dtype, function)) gather a tensor's bands in the
    staging dtype and write ``function(band box, band)`` instead (``--dequantize``: FP8
    bands in, bf16 out).
    """

    def __init__(
        self,
        plan: ReadPlan,
        dtypes: dict[str, torch.dtype],
        where: dict[tuple[str, Box], tuple[str, int]],
        writers: dict[str, FileWriter],
        pool: BufferPool,
        transforms: Mapping[str, tuple[torch.dtype, Transform]] | None = None,
    ) -> None:
        self.plan, self.dtypes, self.where, self.writers, self.pool = (
            plan,
            dtypes,
            where,
            writers,
            pool,
        )
        self.transforms = dict(transforms or {})
        self.buffers: dict[int, torch.Tensor] = {}
        self.taken: dict[int, list[tuple[Box, torch.Tensor]]] = {}
        #: a piece's bytes as (length, CRC32C) per output block it falls in, when the
        #: source's check summed them (:meth:`slab_output`): written without a second sum
        self.known_crcs: dict[Piece, list[tuple[int, int]]] = {}
        self._slab_crcs: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {}

    def slab_output(self, part: Piece, dtype: torch.dtype) -> tuple[int, int] | None:
        """(file offset, the file's checksum block size) where ``part``, in ``dtype``,
        is written unchanged as a slab of whole rows of its target by this rank, or None
        (a cast, a transform, part of a row, a file without block CRC32Cs)."""
        t = self.plan.targets[part.target]
        if (
            t.tensor in self.transforms
            or dtype != self.dtypes[t.tensor]
            or part.box.sizes[1:] != t.box.sizes[1:]
        ):
            return None
        fname, offset = self.where[(t.tensor, t.box)]
        if self.writers[fname].out.sums.algorithm != "crc32c":
            return None  # nothing to combine: no block CRCs, or a sha256 reads every byte
        row = math.prod(t.box.sizes[1:]) * dtype.itemsize
        return offset + (part.box.offsets[0] - t.box.offsets[0]) * row, DEFAULT_BLOCK_SIZE

    def view(self, part: Piece) -> torch.Tensor:
        """The region of the target's staging buffer that ``part`` fills."""
        t = self.plan.targets[part.target]
        buf = self.buffers.get(part.target)
        if buf is None:
            staged = self.transforms.get(t.tensor)
            dtype = staged[0] if staged else self.dtypes[t.tensor]
            buf = self.buffers[part.target] = self.pool.take(t.box.sizes, dtype)
        return buf[part.box.slices_in(t.box)]

    def take(self, part: Piece, data: torch.Tensor) -> bool:
        """Keep ``data`` where it is when it can be written from there: whole-width
        contiguous row slabs, or any 2-D piece whose rows are contiguous."""
        t = self.plan.targets[part.target]
        if (
            not part.box.ndim
            or part.target in self.buffers
            or t.tensor in self.transforms
            or data.dtype != self.dtypes[t.tensor]
            or data.device.type != "cpu"
        ):
            return False
        slab = part.box.sizes[1:] == t.box.sizes[1:] and data.is_contiguous()
        if slab or (part.box.ndim == 2 and data.stride(-1) == 1):
            self.taken.setdefault(part.target, []).append((part.box, data))
            crcs = self.known_crcs.pop(part, None)
            if crcs is not None:
                self._slab_crcs[(part.target, part.box.offsets)] = crcs
            return True
        return False

    def wave_done(self, wave: Wave) -> None:
        """Every band of the wave is complete: queue them for their files, in file order."""
        targets = self.plan.targets
        for ti in sorted(
            {*self.buffers, *self.taken},
            key=lambda i: self.where[(targets[i].tensor, targets[i].box)],
        ):
            t = targets[ti]
            fname, offset = self.where[(t.tensor, t.box)]
            taken = self.taken.pop(ti, [])
            buf = self.buffers.pop(ti, None)
            writer = self.writers[fname]
            if buf is not None and t.tensor in self.transforms:
                out = self.transforms[t.tensor][1](t.box, buf)
                self.pool.give(buf)
                writer.put(offset, out, None)
            elif buf is not None:  # some pieces needed the buffer: assemble the rest there too
                for box, data in taken:
                    buf[box.slices_in(t.box)] = data
                writer.put(offset, buf, self.pool.give)
            elif all(b.sizes[1:] == t.box.sizes[1:] and d.is_contiguous() for b, d in taken):
                row_bytes = math.prod(t.box.sizes[1:]) * self.dtypes[t.tensor].itemsize
                crcs = self._slab_crcs
                for box, data in sorted(taken, key=lambda p: p[0].offsets[0]):
                    at = offset + (box.offsets[0] - t.box.offsets[0]) * row_bytes
                    writer.put(at, data, None, crcs.pop((ti, box.offsets), None))
            else:  # a 2-D band split by columns
                rel = [(box.relative_to(t.box), data) for box, data in taken]
                writer.put_band(
                    offset,
                    (t.box.sizes[0], t.box.sizes[1]),
                    [((b.offsets, b.sizes), d) for b, d in rel],
                )
        self.known_crcs.clear()  # pieces that went another way: summed when written
        self._slab_crcs.clear()


class FileWriter:
    """Streams one output file: header, then target bands strictly in offset order,
    hashed and written on the background threads."""

    def __init__(
        self, staging: Storage, spec: FileSpec, background: BackgroundWriter, checksum: str
    ) -> None:
        self.spec = spec
        self.background = background
        self.raw = staging.open_write(spec.name)
        self.out = HashingWriter(self.raw, checksum, DEFAULT_BLOCK_SIZE)
        self.out.write(spec.header)
        self.next = len(spec.header)  # offset of the next byte to queue
        self.pending: dict[int, tuple[int, Callable[[], None]]] = {}

    def put(
        self,
        offset: int,
        data: torch.Tensor,
        release: Callable[[torch.Tensor], None] | None,
        crcs: list[tuple[int, int]] | None = None,
    ) -> None:
        """Queue ``data`` for ``offset``; ``release(data)`` once it is on its way to storage.
        ``crcs``: its bytes' (length, CRC32C) per output block, when already summed."""
        t = data.contiguous()
        done = functools.partial(release, t) if release is not None else None
        mv = tensor_bytes(t)
        self._queue(offset, mv.nbytes, lambda: self.background.submit(self.out, mv, t, done, crcs))

    def put_band(
        self, offset: int, shape: tuple[int, int], pieces: list[tuple[Any, torch.Tensor]]
    ) -> None:
        """Queue a 2-D band at ``offset`` given by its pieces (see :class:`BandSink`)."""
        n = shape[0] * shape[1] * pieces[0][1].element_size()
        self._queue(offset, n, lambda: self.background.submit_band(self.out, shape, pieces))

    def _queue(self, offset: int, nbytes: int, submit: Callable[[], None]) -> None:
        self.pending[offset] = (nbytes, submit)
        while self.next in self.pending:
            n, go = self.pending.pop(self.next)
            go()
            self.next += n

    def close(self) -> list[Any]:
        if self.pending or self.out.size != self.spec.size:
            raise CheckpointError(
                f"{self.spec.name}: wrote {self.out.size} of {self.spec.size} bytes "
                f"({len(self.pending)} bands out of order): the source does not cover the target"
            )
        self.raw.close()
        return [self.spec.name, self.out.size, self.out.result()]

    def discard(self) -> None:
        # Object-store writers can drop an unfinished upload; a local file is just closed
        # (the coordinator removes the staging folder).
        drop = getattr(self.raw, "discard", None)
        try:
            (drop or self.raw.close)()
        except Exception:  # best effort: the staging area is removed by the coordinator
            logger.debug("closing %s after a failure", self.spec.name, exc_info=True)
