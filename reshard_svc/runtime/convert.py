"""``convert``: any source layout -> any target layout (or one HF folder), offline.

Run by W workers (torchrun; W=1 needs no process group). Every worker computes the same
output plan (files, headers, chunk byte ranges) and the same read plan. Each output file
has one writer worker; its target boxes are cut into row bands on the read plan's grid,
so every band is complete at the end of its wave and is streamed into the file in order
(header first, then data), block CRC32Cs computed on the way. Rank 0 commits the index last; a failed or
killed conversion leaves no committed target.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc import __version__
from reshard_svc.checksums import DEFAULT_BLOCK_SIZE, check_algorithm
from reshard_svc.errors import CheckpointError, LayoutError, UsageError
from reshard_svc.gc import TargetRun
from reshard_svc.index import Blob, CheckpointIndex, Chunk, FileMeta, TensorMeta
from reshard_svc.jobspec import parse_dtype, parse_size
from reshard_svc.layout import Box, Layout, Mesh
from reshard_svc.read_plan import (
    Part,
    ReadPlan,
    Wave,
    band_limit,
    plan_reads,
    row_step,
    split_rows,
    warn_if_over_budget,
)
from reshard_svc.rules import resolve_layouts, select_tensors
from reshard_svc.runtime.buffers import BackgroundWriter, BufferPool, tensor_bytes
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.exchange import Progress, execute
from reshard_svc.runtime.load import open_shared
from reshard_svc.safetensors_io import dtype_from_name, encode_header, itemsize
from reshard_svc.save_plan import FileSpec, TensorPlacement, plan_save
from reshard_svc.sources import HF_INDEX
from reshard_svc.storage import HashingWriter, Storage, open_storage

__all__ = ["ConvertResult", "DEFAULT_SHARD_SIZE", "convert", "parse_size"]

logger = logging.getLogger(__name__)

DEFAULT_CONVERT_MEMORY = 1024**3
DEFAULT_SHARD_SIZE = 5 * 1000**3  # HF's default max_shard_size

#: Cost model constants (see ``choose_strategy``). Local page-cache reads are far faster
#: than gloo's ~2-3 GB/s exchange; object stores pay per request and per byte.
EXCHANGE_BANDWIDTH = 2.5e9


#: What ``dtype=`` may cast floating-point tensors to.
CAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _cast_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return dtype_from_name(parse_dtype(dtype))  # type: ignore[arg-type]
    if dtype not in CAST_DTYPES:
        raise UsageError(
            f"dtype {dtype} would destroy floating-point weights: cast only to bf16, "
            "fp16, fp32 or fp64 (quantize with a quantization tool instead)"
        )
    return dtype


@dataclass(frozen=True)
class ConvertResult:
    index: CheckpointIndex
    strategy: str
    bytes_read: int  # by this worker
    bytes_read_total: int  # by all workers
    bytes_exchanged: int
    bytes_written_total: int
    waves: int


@dataclass(frozen=True)
class OutputPlan:
    files: tuple[FileSpec, ...]  # FileSpec.writer is the worker rank
    chunks: dict[str, tuple[Chunk, ...]]
    layouts: dict[str, Layout | None]
    dtypes: dict[str, torch.dtype]


def _assign_files(files: list[FileSpec], workers: int) -> list[FileSpec]:
    """Each output file gets one writer worker, balancing bytes (deterministic)."""
    load = [0] * workers
    out = []
    for spec in sorted(files, key=lambda f: (-f.size, f.name)):
        w = min(range(workers), key=lambda r: (load[r], r))
        load[w] += spec.size
        out.append(FileSpec(spec.name, w, spec.entries, spec.header, spec.size))
    return sorted(out, key=lambda f: f.name)


def plan_native(
    index: CheckpointIndex, layouts: dict[str, Layout], dtypes: dict[str, torch.dtype],
    workers: int, token: str, suffix: str,
) -> OutputPlan:  # fmt: skip
    world = max((lay.mesh.size for lay in layouts.values()), default=1)
    placements = []
    for name, meta in index.tensors.items():
        lay = layouts[name]
        items = lay.write_items(meta.shape)
        placements.append(
            TensorPlacement(
                name, dtypes[name], meta.shape, lay, tuple((it.box, it.holders) for it in items)
            )
        )
    plan = plan_save(placements, world, token=token, file_suffix=suffix)
    return OutputPlan(
        tuple(_assign_files(list(plan.files), workers)), plan.chunks, dict(layouts), dtypes
    )


def plan_hf(
    index: CheckpointIndex, dtypes: dict[str, torch.dtype], workers: int, max_shard: int
) -> OutputPlan:
    """Consolidated HF export: whole tensors in size-capped ``model-0000i-of-0000N`` files."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(index.tensors):
        meta = index.tensors[name]
        n = math.prod(meta.shape) * itemsize(dtypes[name])
        if groups[-1] and size + n > max_shard:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    total = len(groups)
    files: list[FileSpec] = []
    chunks: dict[str, tuple[Chunk, ...]] = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        header, ranges = encode_header(
            [(n, dtypes[n], index.tensors[n].shape) for n in names], {"format": "pt"}
        )
        end = len(header)
        for name in names:
            b, e = ranges[name]
            shape = index.tensors[name].shape
            chunks[name] = (
                (Chunk(Box((0,) * len(shape), shape), fname, b, e),) if math.prod(shape) else ()
            )
            end = max(end, e)
        full = tuple(
            (n, Box((0,) * len(index.tensors[n].shape), index.tensors[n].shape)) for n in names
        )
        files.append(FileSpec(fname, 0, full, header, end))
    return OutputPlan(
        tuple(_assign_files(files, workers)), chunks, dict.fromkeys(index.tensors), dtypes
    )


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
            out[key] = Blob(key, name, start, writer.size, b.encoding)
    block_size = DEFAULT_BLOCK_SIZE if algorithm != "none" else None
    return FileMeta.from_written(name, writer.size, writer.result(), block_size), out


def choose_strategy(plans: dict[str, ReadPlan], storage: Storage) -> str:
    """The cheaper of exchange/direct under a simple cost model.

    cost(direct)   = requests x latency + bytes read (over-reads included) / storage bw
    cost(exchange) = requests x latency + bytes read / storage bw + bytes moved / ~2.5 GB/s
    Both sides are spread over the workers, so totals are divided by the worker count.
    """

    def cost(p: ReadPlan) -> float:
        w = max(1, p.world)
        return (
            p.reads_count() * storage.latency_s / w
            + sum(p.bytes_read()) / storage.bandwidth / w
            + p.bytes_exchanged() / EXCHANGE_BANDWIDTH
        )

    return min(plans, key=lambda k: (cost(plans[k]), k != "exchange"))


def convert(
    src: str,
    dst: str,
    *,
    mesh: Mesh | str | None = None,
    rules: str | Mapping[str, Any] | None = None,
    format: str = "native",
    dtype: str | torch.dtype | None = None,
    strategy: str = "auto",
    max_memory: int | str | None = None,
    max_shard_size: int | str | None = None,
    process_group: Any = None,
    progress: Progress | None = None,
    storage_options: Mapping[str, Any] | None = None,
    checksum: str | bool = "crc32c",
    overwrite: bool = False,
    only: Sequence[str] | None = None,
    strip_prefix: str | None = None,
) -> ConvertResult:
    """Convert checkpoint ``src`` into ``dst`` with new layouts, format or dtype.

    Called by every worker of ``process_group`` (or one process without one). ``mesh``
    (``"tp=4"``, ``"dp=2,tp=4"``) and ``rules`` (glob -> placements) choose the target
    layouts; ``format="hf"`` writes one consolidated HF folder instead. ``max_memory`` is
    the per-worker byte budget for in-flight data. ``checksum`` is what the output
    records: ``"crc32c"`` block CRCs (default), ``"sha256"`` (those plus a whole-file
    sha256) or ``"none"``. Every source block read is checked against its CRC32C first.
    A committed checkpoint at ``dst`` is only replaced with ``overwrite=True``. ``only``
    (globs) keeps matching tensors, and ``strip_prefix`` drops a name prefix, e.g.
    ``only=["model.*"], strip_prefix="model."`` for a loadable HF model folder.
    """
    algorithm = check_algorithm(checksum)
    if format not in ("native", "hf"):
        raise UsageError(f"format must be 'native' or 'hf', got {format!r}")
    if strategy not in ("auto", "exchange", "direct"):
        raise UsageError(f"strategy must be auto, exchange or direct, got {strategy!r}")
    budget = parse_size(max_memory, "max_memory") or DEFAULT_CONVERT_MEMORY
    shard_cap = parse_size(max_shard_size, "max_shard_size") or DEFAULT_SHARD_SIZE
    out_dtype = _cast_dtype(dtype)
    comm = Comm(process_group)
    storage, index = open_shared(src, comm, storage_options)
    index = select_tensors(index, only, strip_prefix)
    target = open_storage(dst, storage_options)
    if target.uri.rstrip("/") == storage.uri.rstrip("/"):
        raise LayoutError("source and target are the same folder: convert into a new target")

    def prepare() -> dict[str, Any]:
        layouts = resolve_layouts(index, mesh, rules) if format == "native" else {}
        state["layouts"] = layouts
        if comm.rank == 0:
            state["run"] = TargetRun(target, "convert", overwrite)
            return {"token": state["run"].token}
        return {"token": ""}

    state: dict[str, Any] = {}
    _, infos = comm.run_everywhere("convert: planning target layouts", prepare)
    token = infos[0]["token"]
    staging = target.staging(token)
    run: TargetRun | None = state.get("run")
    try:
        # A cast applies to floating-point tensors; integer and bool tensors (step counters,
        # masks) keep their dtype.
        dtypes = {
            n: out_dtype if out_dtype is not None and m.dtype.is_floating_point else m.dtype
            for n, m in index.tensors.items()
        }
        if format == "native":
            out = plan_native(
                index, state["layouts"], dtypes, comm.world, token, staging.file_suffix
            )
        else:
            out = plan_hf(index, dtypes, comm.world, shard_cap)

        # Target boxes cut on the read plan's row grid; each band lands at a known file offset.
        writer_of = {f.name: f.writer for f in out.files}
        wanted: dict[str, list[tuple[Box, tuple[int, ...]]]] = {}
        where: dict[tuple[str, Box], tuple[str, int]] = {}
        for name, chunks in out.chunks.items():
            meta = index.tensors[name]
            step = row_step(meta.shape, meta.itemsize, band_limit(budget))
            osz = itemsize(dtypes[name])
            bands: list[tuple[Box, tuple[int, ...]]] = []
            for c in chunks:
                row = math.prod(c.box.sizes[1:]) * osz if c.box.ndim else 0
                for band in split_rows(c.box, step):
                    off = (band.offsets[0] - c.box.offsets[0]) * row if band.ndim else 0
                    where[(name, band)] = (c.file, c.begin + off)
                    bands.append((band, (writer_of[c.file],)))
            wanted[name] = bands
        warn_if_over_budget(index, wanted, budget)
        plans = {}
        for s in ("exchange", "direct") if strategy == "auto" else (strategy,):
            plans[s] = plan_reads(index, wanted, comm.world, budget, strategy=s)
        chosen = choose_strategy(plans, storage) if len(plans) > 1 else strategy
        plan = plans[chosen]
        logger.info("convert %s -> %s: %s strategy, %d waves", src, dst, chosen, len(plan.waves))
    except BaseException:
        if run is not None:
            run.abort(staging)
        raise

    my_files = [f for f in out.files if f.writer == comm.rank]
    writers: dict[str, _FileWriter] = {}
    sink = _BandSink(plan, dtypes, where, writers, BufferPool(max(1, budget // 2)))
    background = BackgroundWriter(max(1, budget // 4))

    def open_writers() -> None:
        for spec in my_files:
            writers[spec.name] = _FileWriter(staging, spec, background, algorithm)

    src_dtypes = {n: m.dtype for n, m in index.tensors.items()}
    try:
        # Each step fails on every rank together (execute agrees per wave), so no rank is
        # ever left waiting in a collective its peers abandoned.
        comm.run_everywhere("convert: opening output files", open_writers)
        bytes_read = execute(
            plan, storage, src_dtypes, comm, sink.put, progress, sink.flush,
            dest_view=sink.view,
            blocks=index.block_tables(),
            check_in_place=False,
        )  # fmt: skip

        def close_all() -> list[Any]:
            background.drain()
            return [bytes_read, [w.close() for w in writers.values()]]

        _, results = comm.run_everywhere("convert: closing output files", close_all)
    except BaseException:
        with contextlib.suppress(Exception):
            background.close()
        for w in writers.values():
            w.discard()
        if run is not None:
            run.abort(staging)
        raise
    block_size = DEFAULT_BLOCK_SIZE if algorithm != "none" else None
    files = {
        name: FileMeta.from_written(name, size, sums, block_size)
        for r in results
        for name, size, sums in r[1]
    }
    result_index = CheckpointIndex(
        tensors={
            n: TensorMeta(n, dtypes[n], m.shape, out.layouts.get(n), out.chunks.get(n, ()))
            for n, m in index.tensors.items()
        },
        files=files,
        extras=dict(index.extras),
        created_by=f"reshard_svc {__version__}",
        checksum=algorithm,
        block_size=block_size,
    )

    def commit() -> None:
        if run is None:
            return
        try:
            if index.blobs and format == "native":
                name = f"opaque{staging.file_suffix}.bin"
                meta, blobs = copy_blobs(index, storage, staging, name, algorithm)
                result_index.files[name] = meta
                result_index.blobs = blobs
            elif index.blobs:
                logger.warning(
                    "an HF folder holds tensors only: %d opaque item(s) (e.g. %r) not exported",
                    len(index.blobs), next(iter(index.blobs)),
                )  # fmt: skip
            result_index.check()
            if format == "hf":
                weight_map = {n: spec.name for spec in out.files for n, _ in spec.entries}
                total = sum(m.nbytes for m in result_index.tensors.values())
                staging.write(
                    HF_INDEX,
                    json.dumps(
                        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2
                    ).encode(),
                )
        except BaseException:
            run.abort(staging)
            raise
        run.commit(staging, result_index.dumps())

    background.close()
    comm.run_everywhere("convert: commit", commit)
    return ConvertResult(
        result_index,
        chosen,
        bytes_read,
        sum(r[0] for r in results),
        plan.bytes_exchanged(),
        sum(f.size for f in files.values()),
        len(plan.waves),
    )


class _BandSink:
    """Where a worker's target bands gather during a wave, and how they reach their files.

    A band that arrives as whole-width row slabs (a row-sharded target from row-sharded
    sources: each slab is a contiguous piece of a verified memory map or of a receive
    buffer) is written slab by slab, never copied. Any other band is assembled in a
    pooled buffer that goes back to the pool once it is written.
    """

    def __init__(
        self,
        plan: ReadPlan,
        dtypes: dict[str, torch.dtype],
        where: dict[tuple[str, Box], tuple[str, int]],
        writers: dict[str, _FileWriter],
        pool: BufferPool,
    ) -> None:
        self.plan, self.dtypes, self.where, self.writers, self.pool = (
            plan, dtypes, where, writers, pool
        )  # fmt: skip
        self.buffers: dict[int, torch.Tensor] = {}
        self.slabs: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def view(self, part: Part) -> torch.Tensor:
        """The region of the target's staging buffer that ``part`` fills."""
        t = self.plan.targets[part.target]
        buf = self.buffers.get(part.target)
        if buf is None:
            buf = self.buffers[part.target] = self.pool.take(t.box.sizes, self.dtypes[t.tensor])
        return buf[part.box.slices_in(t.box)]

    @torch.no_grad()
    def put(self, part: Part, data: torch.Tensor) -> None:
        t = self.plan.targets[part.target]
        if (
            part.box.ndim
            and part.box.offsets[1:] == t.box.offsets[1:]
            and part.box.sizes[1:] == t.box.sizes[1:]
            and part.target not in self.buffers
            and data.dtype == self.dtypes[t.tensor]
            and data.is_contiguous()
        ):
            self.slabs.setdefault(part.target, []).append((part.box.offsets[0], data))
            return
        self.view(part).copy_(data)

    def flush(self, wave: Wave) -> None:
        """Every band of the wave is complete: queue them for their files, in file order."""
        targets = self.plan.targets
        for ti in sorted(
            {*self.buffers, *self.slabs},
            key=lambda i: self.where[(targets[i].tensor, targets[i].box)],
        ):
            t = targets[ti]
            fname, offset = self.where[(t.tensor, t.box)]
            slabs = sorted(self.slabs.pop(ti, []), key=lambda s: s[0])
            buf = self.buffers.pop(ti, None)
            if buf is not None:  # a band that also got non-slab parts: assemble it all
                for row, data in slabs:
                    buf[row - t.box.offsets[0] : row - t.box.offsets[0] + data.shape[0]] = data
                self.writers[fname].put(offset, buf, self.pool.give)
                continue
            row_bytes = math.prod(t.box.sizes[1:]) * self.dtypes[t.tensor].itemsize
            for row, data in slabs:
                self.writers[fname].put(offset + (row - t.box.offsets[0]) * row_bytes, data, None)


class _FileWriter:
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
        self.pending: dict[int, tuple[torch.Tensor, Any]] = {}

    def put(
        self, offset: int, data: torch.Tensor, release: Callable[[torch.Tensor], None] | None
    ) -> None:
        """Queue ``data`` for ``offset``; ``release(data)`` once it is on its way to storage."""
        self.pending[offset] = (data, release)
        while self.next in self.pending:
            t, rel = self.pending.pop(self.next)
            t = t.contiguous()
            mv = tensor_bytes(t)
            done = functools.partial(rel, t) if rel is not None else None
            self.background.submit(self.out, mv, keep=t, done=done)
            self.next += mv.nbytes

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
