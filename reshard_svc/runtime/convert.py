"""``convert``: any source layout -> any target layout (or one HF folder), offline.

Run by W workers (torchrun; W=1 needs no process group). Every worker computes the same
output plan (files, headers, chunk byte ranges) and the same read plan. Each output file
has one writer worker; its target boxes are cut into row bands on the read plan's grid,
so every band is complete at the end of its wave and is streamed into the file in order
(header first, then data), block CRC32Cs computed on the way. Rank 0 commits the index
last; a failed or killed conversion leaves no committed target.

The steps, in order (:class:`Conversion`): open the source and the target, plan (output
files, target bands, reads), open this worker's output files, execute the waves, close,
commit. The pure plans live in :mod:`reshard_svc.plan.output` and
:mod:`reshard_svc.plan.read`; where bytes go, in :mod:`reshard_svc.runtime.writers`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from typing import Any

import torch

from reshard_svc._collector import collector_paused
from reshard_svc._version import __version__
from reshard_svc.errors import UsageError
from reshard_svc.format.checksums import DEFAULT_BLOCK_SIZE, check_algorithm
from reshard_svc.format.collect import TargetRun
from reshard_svc.format.hf import HF_INDEX
from reshard_svc.format.index import CheckpointIndex, FileMeta, TensorMeta
from reshard_svc.format.safetensors import dtype_from_name
from reshard_svc.format.target import check_distinct
from reshard_svc.format.values import flat_values
from reshard_svc.jobs.spec import ConvertSpec, Device, Format, parse_mesh
from reshard_svc.layout import Box, Mesh
from reshard_svc.plan.budget import io_threads as count_io_threads
from reshard_svc.plan.budget import parse_size
from reshard_svc.plan.items import Held, Piece, Wave
from reshard_svc.plan.names import parse_renames, select_tensors, split_layers
from reshard_svc.plan.output import (
    DEFAULT_SHARD_SIZE,
    OutputPlan,
    plan_hf,
    plan_native,
    target_bands,
)
from reshard_svc.plan.quant import dequantize_box, fp8_pairs, is_fp8, scale_box, scale_tensors
from reshard_svc.plan.read import ReadPlan, StorageCost, choose_plan, warn_if_over_budget
from reshard_svc.plan.rules import load_rules, resolve_layouts
from reshard_svc.runtime.buffers import BackgroundWriter, BufferPool
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.executor import Progress, execute
from reshard_svc.runtime.load import open_shared
from reshard_svc.runtime.reading import StorageSource
from reshard_svc.runtime.writers import BandSink, FileWriter, copy_blobs, copy_model_files
from reshard_svc.storage import Storage, open_storage

__all__ = ["ConvertResult", "DEFAULT_SHARD_SIZE", "convert", "parse_size"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ConvertResult:
    """What :func:`convert` did, on this worker (every worker returns one; the totals are
    the same on all): the index it committed, the read strategy that ran, the bytes read
    by this worker and by all, moved between workers and written, the waves, and how many
    tensors were cast, kept their dtype or were dequantized."""

    index: CheckpointIndex
    strategy: str
    bytes_read: int  # by this worker
    bytes_read_total: int  # by all workers
    bytes_exchanged: int
    bytes_written_total: int
    waves: int
    cast: int = 0  # tensors cast to the spec's dtype
    kept: int = 0  # floating tensors that kept theirs (0-dim, FP8 and scales, keep_dtype)
    dequantized: int = 0  # FP8 weights dequantized with their block scales

    @property
    def tensors(self) -> int:
        """Tensors in the committed checkpoint."""
        return len(self.index.tensors)


def convert(
    src: str,
    dst: str,
    *,
    mesh: Mesh | str | Mapping[str, int] | None = None,
    rules: str | Mapping[str, Any] | None = None,
    format: str = "native",
    dtype: str | torch.dtype | None = None,
    keep_dtype: Sequence[str] | None = None,
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
    copy_config: bool = True,
    rename: Sequence[str] | Mapping[str, str] | None = None,
    split_layers: bool = False,
    dequantize: str | None = None,
    io_threads: int | None = None,
    device: str = "auto",
) -> ConvertResult:
    """Convert checkpoint ``src`` into ``dst`` with new layouts, format or dtype.

    Called by every worker of ``process_group`` (or one process without one). ``mesh``
    (``"tp=4"``, ``"dp=2,tp=4"``: named dims) and ``rules`` (glob -> placements) choose
    the target layouts; ``format="hf"`` writes one consolidated HF folder instead (into a
    model folder, whose config and tokenizer files stay; ``copy_config`` copies the
    source's). ``dtype`` casts floating-point tensors of one or more dims (0-dim scalars,
    such as an optimizer's ``step``, and names matching a ``keep_dtype`` glob keep theirs).
    ``max_memory`` is the per-worker byte budget for in-flight data. ``checksum`` is what
    the output records: ``"crc32c"`` block CRCs (default), ``"sha256"`` (those plus a
    whole-file sha256) or ``"none"``. Every source block read is checked against its
    CRC32C first. A committed checkpoint at ``dst`` is only replaced with
    ``overwrite=True``. ``only`` (globs) keeps matching tensors, and ``strip_prefix``
    drops a name prefix, e.g. ``only=["model.*"], strip_prefix="model."``; ``rename``
    (``"FROM_GLOB=TO_PATTERN"`` rules or an ordered ``{FROM: TO}``) renames first, e.g.
    ``rename=["layers.*.wq.weight=model.layers.*.q_proj.weight"]``; before that,
    ``split_layers=True`` makes Megatron-Core's stacked ``[L, ...]`` tensors one tensor per
    layer (see :mod:`reshard_svc.plan.names`). FP8 tensors and their scales keep their
    dtype under ``dtype``; ``dequantize="fp8-block"`` multiplies block-scaled FP8 weights by
    their ``*_scale_inv`` (in float32), casts them to ``dtype`` (bf16 by default) and drops
    the scales (see :mod:`reshard_svc.plan.quant`). ``io_threads`` caps the threads that
    check and write this worker's files (default: ``RESHARD_IO_THREADS``, else from the
    host). ``device`` is where the exchange runs: here, the backend of ``process_group``
    decides, and ``"cuda"`` (``"cpu"``) refuses a group that is not NCCL (is NCCL).

    The arguments make one :class:`~reshard_svc.jobs.spec.ConvertSpec` (the job contract
    the CLI, the server and the worker use too), checked in one place.
    """
    # as typed by a caller (text for the enums and sizes): ConvertSpec.checked parses them
    options: dict[str, Any] = {
        "mesh": _mesh_names(mesh),
        "rules": dict(load_rules(rules)) if rules is not None else None,
        "format": format,
        "dtype": _dtype_name(dtype),
        "keep_dtype": list(keep_dtype) if keep_dtype else None,
        "strategy": strategy,
        "checksum": check_algorithm(checksum),
        "max_memory": _size_text(max_memory),
        "max_shard_size": _size_text(max_shard_size),
        "overwrite": overwrite,
        "only": list(only) if only else None,
        "strip_prefix": strip_prefix,
        "copy_config": copy_config,
        "rename": _rename_texts(rename),
        "split_layers": split_layers,
        "dequantize": dequantize,
        "io_threads": io_threads,
        "device": device,
    }
    spec = ConvertSpec(source=src, target=dst, **options).checked()
    conversion = Conversion(spec, process_group=process_group, storage_options=storage_options)
    with collector_paused():  # see reshard_svc._collector: no full collection mid-run
        return conversion.run(progress)


def scale_rows(shape: Sequence[int], ranks: Mapping[int, tuple[int, int]]) -> list[Held]:
    """Row ranges of a scale tensor that ranks need, as disjoint full-width boxes, each with
    every rank that needs it (an interval sweep over the range ends)."""
    cuts = sorted({x for lo, hi in ranks.values() for x in (lo, hi)})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        holders = tuple(sorted(r for r, (a, b) in ranks.items() if a <= lo and hi <= b))
        if holders:
            box = Box((lo, *(0,) * (len(shape) - 1)), (hi - lo, *shape[1:]))
            out.append(Held(box=box, holders=holders))
    return out


class _IntoScales:
    """The scale pass's destination: each rank's rows of the scale tensors it needs."""

    def __init__(self, plan: ReadPlan, held: dict[str, tuple[Box, torch.Tensor]]) -> None:
        self.targets, self.held = plan.targets, held

    def view(self, piece: Piece) -> torch.Tensor:
        at, buf = self.held[self.targets[piece.target].tensor]
        return buf[piece.box.slices_in(at)]

    def take(self, piece: Piece, data: torch.Tensor) -> bool:
        return False

    def wave_done(self, wave: Wave) -> None:
        pass


def _rename_texts(rename: Sequence[str] | Mapping[str, str] | None) -> list[str] | None:
    rules = parse_renames(dict(rename) if isinstance(rename, Mapping) else rename)
    return [str(r) for r in rules] if rules else None


def _mesh_names(mesh: Mesh | str | Mapping[str, int] | None) -> dict[str, int] | None:
    if mesh is None or isinstance(mesh, Mapping):
        return parse_mesh(mesh)
    m = Mesh.parse(mesh) if isinstance(mesh, str) else mesh
    if m.names is None:
        raise UsageError(f"mesh {m}: name every dim, e.g. tp=4 or dp=2,tp=4")
    return dict(zip(m.names, m.shape))


def _dtype_name(dtype: str | torch.dtype | None) -> str | None:
    if dtype is None or isinstance(dtype, str):
        return dtype
    return str(dtype).removeprefix("torch.")


def check_device(device: str, comm: Comm) -> None:
    """``device`` against the process group this worker converts in: ``cuda`` needs NCCL
    (and a GPU), ``cpu`` a group on the CPU; ``auto`` takes the group as it is."""
    on_gpu = comm.device.type == "cuda"
    if device == Device.CUDA and not on_gpu:
        why = "no NCCL process group" if torch.cuda.is_available() else "no CUDA GPU here"
        raise UsageError(f"device cuda: {why}; pass device='auto' or 'cpu'")
    if device == Device.CPU and on_gpu:
        raise UsageError("device cpu: the process group is NCCL's; pass a gloo group")


def _size_text(size: int | str | None) -> str | None:
    return None if size is None else str(size)


class Conversion:
    """One conversion on this worker, as named steps over one checked
    :class:`~reshard_svc.jobs.spec.ConvertSpec`. Every step that can fail runs through
    ``comm.run_everywhere``, so all workers fail together and none is left in a
    collective its peers abandoned; any failure before the commit drops the staging data.
    """

    staging: Storage  # the target's staging area, set by open_target

    def __init__(
        self,
        spec: ConvertSpec,
        *,
        process_group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.budget = spec.budget("convert")
        self.shard_cap = parse_size(spec.max_shard_size, "max_shard_size") or DEFAULT_SHARD_SIZE
        self.out_dtype = dtype_from_name(spec.dtype) if spec.dtype else None
        self.mesh = Mesh(tuple(spec.mesh.values()), tuple(spec.mesh)) if spec.mesh else None
        self.comm = Comm(process_group)
        check_device(spec.device, self.comm)
        self.io_threads = count_io_threads(spec.io_threads)
        self.storage_options = storage_options
        self.run_: TargetRun | None = None
        #: whether :meth:`open_target` took the target: then ``token`` is the run's and
        #: ``staging`` its staging area (a dry run plans without them)
        self.opened = False
        self.token = "0" * 32
        self.writers: dict[str, FileWriter] = {}

    def run(self, progress: Progress | None) -> ConvertResult:
        self.open()
        try:
            out, plan, where, chosen = self.plan()
        except BaseException:
            self.abort()
            raise
        background = BackgroundWriter(self.budget.writer, max_streams=self.io_threads)
        try:
            bytes_read, results = self.execute(out, plan, where, background, progress)
        except BaseException:
            with contextlib.suppress(Exception):
                background.close()
            for w in self.writers.values():
                w.discard()
            self.abort()
            raise
        background.close()
        index = self.result_index(out, results)
        self.comm.run_everywhere("convert: commit", lambda: self.commit(out, index))
        return ConvertResult(
            index=index,
            strategy=chosen,
            bytes_read=bytes_read,
            bytes_read_total=sum(r[0] for r in results),
            bytes_exchanged=plan.bytes_exchanged(),
            bytes_written_total=sum(f.size for f in index.files.values()),
            waves=len(plan.waves),
            cast=self.cast,
            kept=self.kept,
            dequantized=len(self.pairs),
        )

    # ---- steps

    def open(self) -> None:
        """Open the source (rank 0 reads its index, all share it) and the target; rank 0
        checks the target and takes its lease."""
        check_distinct(self.spec.source, self.spec.target, self.storage_options)
        self.open_source()
        self.open_target()

    def open_source(self) -> None:
        """The source's index, as the conversion sees it: layers split, tensors selected
        and renamed, FP8 scales set aside; and each tensor's target layout."""
        spec = self.spec
        self.storage, index = open_shared(spec.source, self.comm, self.storage_options)
        if spec.split_layers:
            index = split_layers(index)
        self.index = select_tensors(index, spec.only, spec.strip_prefix, parse_renames(spec.rename))
        # --dequantize: the source keeps the scales (they are read); the output drops them
        self.source_index = self.index
        self.pairs = fp8_pairs(self.index.tensors) if spec.dequantize else {}
        if spec.dequantize and not self.pairs:
            raise UsageError(
                f"--dequantize {spec.dequantize}: {spec.source} has no FP8 tensor to dequantize"
            )
        if self.pairs:
            scales = {p.scale for p in self.pairs.values()}
            kept = {n: m for n, m in self.index.tensors.items() if n not in scales}
            self.index = dc_replace(self.index, tensors=kept)
        native = spec.format == Format.NATIVE
        self.layouts = resolve_layouts(self.index, self.mesh, spec.rules) if native else {}

    def open_target(self) -> None:
        spec = self.spec
        native = spec.format == Format.NATIVE
        self.target = open_storage(spec.target, self.storage_options)

        def take_target() -> TargetRun | None:
            if self.comm.rank != 0:
                return None
            return TargetRun(self.target, "convert", spec.overwrite, model_folder=not native)

        self.run_, tokens = self.comm.run_everywhere(
            "convert: taking the target",
            take_target,
            share=lambda run: run.token if run is not None else "",
        )
        self.token = tokens[0]
        self.staging = self.target.staging(self.token)
        self.opened = True

    def plan(
        self, world: int | None = None
    ) -> tuple[OutputPlan, ReadPlan, dict[tuple[str, Box], tuple[str, int]], str]:
        """The output plan, where each target band lands, and the read plan (``auto``:
        the cheaper strategy for this source storage), for this job's workers (or for
        ``world`` of them: a dry run, before any target is taken)."""
        dequant_to = (self.out_dtype or torch.bfloat16) if self.pairs else None
        self.dtypes, self.cast, self.kept = cast_dtypes(
            self.index, self.out_dtype, self.spec.keep_dtype, dequant_to
        )
        world = world or self.comm.world
        if self.spec.format == Format.NATIVE:
            suffix = self.staging.file_suffix if self.opened else ""
            out = plan_native(self.index, self.layouts, self.dtypes, world, self.token, suffix)
        else:
            out = plan_hf(self.index, self.dtypes, world, self.shard_cap)
        self.file_writer = {f.name: f.writer for f in out.files}
        wanted, where = target_bands(out, self.index, self.budget)
        warn_if_over_budget(self.index, wanted, self.budget)
        plan = choose_plan(
            self.index,
            wanted,
            world,
            self.budget,
            str(self.spec.strategy),
            StorageCost.of(self.storage),
        )
        chosen = plan.strategy
        logger.info(
            "convert %s -> %s: %s strategy, %d waves",
            self.spec.source,
            self.spec.target,
            chosen,
            len(plan.waves),
        )
        return out, plan, where, chosen

    def execute(
        self,
        out: OutputPlan,
        plan: ReadPlan,
        where: dict[tuple[str, Box], tuple[str, int]],
        background: BackgroundWriter,
        progress: Progress | None,
    ) -> tuple[int, list[Any]]:
        """Open this worker's files, run the waves, close the files: (bytes this worker
        read, every worker's [bytes read, [(file, size, checksums)]])."""
        transforms = self.read_scales(where) if self.pairs else {}
        sink = BandSink(
            plan,
            self.dtypes,
            where,
            self.writers,
            BufferPool(self.budget.buffers),
            transforms={n: (self.index.tensors[n].dtype, f) for n, f in transforms.items()},
        )

        def open_writers() -> None:
            for spec in out.files:
                if spec.writer == self.comm.rank:
                    self.writers[spec.name] = FileWriter(
                        self.staging, spec, background, self.spec.checksum
                    )

        self.comm.run_everywhere("convert: opening output files", open_writers)
        source = StorageSource(
            self.storage,
            {n: m.dtype for n, m in self.index.tensors.items()},
            self.comm.rank,
            self.index.block_tables(),
            check_in_place=False,
            io_threads=self.io_threads,
        )
        bytes_read = execute(plan, source, self.comm, sink, progress=progress)

        def close_all() -> list[Any]:
            background.drain()
            return [bytes_read, [w.close() for w in self.writers.values()]]

        _, results = self.comm.run_everywhere("convert: closing output files", close_all)
        return bytes_read, results

    def read_scales(
        self, where: dict[tuple[str, Box], tuple[str, int]]
    ) -> dict[str, Callable[[Box, torch.Tensor], torch.Tensor]]:
        """``--dequantize``: every worker gets the scale rows its own bands of FP8 weights
        need (one plan and exchange of their own: each stored scale byte read once), and a
        transform per weight that dequantizes a band with them."""
        need: dict[str, dict[int, tuple[int, int]]] = {}  # scale -> rank -> its rows
        for (tensor, box), (fname, _) in where.items():
            pair = self.pairs.get(tensor)
            if pair is None or not box.numel:
                continue
            sbox = scale_box(box)
            lo, hi = sbox.offsets[0], sbox.offsets[0] + sbox.sizes[0]
            ranks = need.setdefault(pair.scale, {})
            rank = self.file_writer[fname]
            got = ranks.get(rank)
            ranks[rank] = (min(lo, got[0]), max(hi, got[1])) if got else (lo, hi)
        wanted = {
            s: scale_rows(self.source_index.tensors[s].shape, ranks) for s, ranks in need.items()
        }
        held: dict[str, tuple[Box, torch.Tensor]] = {}
        for s, ranks in need.items():
            if self.comm.rank in ranks:
                lo, hi = ranks[self.comm.rank]
                shape = self.source_index.tensors[s].shape
                at = Box((lo, *(0,) * (len(shape) - 1)), (hi - lo, *shape[1:]))
                held[s] = (at, torch.empty(at.sizes, dtype=self.source_index.tensors[s].dtype))
        plan = choose_plan(
            self.source_index,
            wanted,
            self.comm.world,
            self.budget,
            str(self.spec.strategy),
            StorageCost.of(self.storage),
        )
        source = StorageSource(
            self.storage,
            {n: m.dtype for n, m in self.source_index.tensors.items()},
            self.comm.rank,
            self.source_index.block_tables(),
        )
        execute(plan, source, self.comm, _IntoScales(plan, held))
        out_dtypes = self.dtypes

        def transform(weight: str) -> Callable[[Box, torch.Tensor], torch.Tensor]:
            at, scale = held[self.pairs[weight].scale]
            return lambda box, data: dequantize_box(data, box, scale, at, out_dtypes[weight])

        mine = {t for (t, _), (f, _) in where.items() if self.file_writer[f] == self.comm.rank}
        return {w: transform(w) for w in self.pairs if w in mine and self.pairs[w].scale in held}

    def result_index(self, out: OutputPlan, results: list[Any]) -> CheckpointIndex:
        block_size = DEFAULT_BLOCK_SIZE if self.spec.checksum != "none" else None
        files = {
            name: FileMeta.from_written(name, size, sums, block_size)
            for r in results
            for name, size, sums in r[1]
        }
        return CheckpointIndex(
            tensors={
                n: TensorMeta(
                    name=n,
                    dtype=self.dtypes[n],
                    shape=m.shape,
                    layout=out.layouts.get(n),
                    chunks=out.chunks.get(n, ()),
                )
                for n, m in self.index.tensors.items()
            },
            files=files,
            extras=flat_values(self.index.extras),
            created_by=f"reshard_svc {__version__}",
            checksum=self.spec.checksum,
            block_size=block_size,
        )

    def commit(self, out: OutputPlan, result: CheckpointIndex) -> None:
        """Rank 0: copy opaque items, write the HF index if any, commit the index last."""
        run = self.run_
        if run is None:
            return
        staging, index = self.staging, self.index
        hf = self.spec.format == Format.HF
        try:
            if index.blobs and not hf:
                name = f"opaque{staging.file_suffix}.bin"
                meta, blobs = copy_blobs(index, self.storage, staging, name, self.spec.checksum)
                result.files[name] = meta
                result.blobs = blobs
            elif index.blobs:
                logger.warning(
                    "an HF folder holds tensors only: %d opaque item(s) (e.g. %r) not exported",
                    len(index.blobs),
                    next(iter(index.blobs)),
                )
            result.check()
            if hf:
                weight_map = {n: spec.name for spec in out.files for n, _ in spec.entries}
                total = sum(m.nbytes for m in result.tensors.values())
                hf_index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                staging.write(HF_INDEX, json.dumps(hf_index, indent=2).encode())
                if self.spec.copy_config:
                    copy_model_files(self.storage, self.target, staging)
        except BaseException:
            run.abort(staging)
            raise
        run.commit(staging, result.dumps())

    def abort(self) -> None:
        if self.run_ is not None:
            self.run_.abort(self.staging)


def cast_dtypes(
    index: CheckpointIndex,
    dtype: torch.dtype | None,
    keep: Sequence[str] | None,
    dequantize_to: torch.dtype | None = None,
) -> tuple[dict[str, torch.dtype], int, int]:
    """Each tensor's output dtype, and how many were cast and how many kept theirs.

    A cast applies to floating-point tensors of one or more dims: 0-dim scalars (an
    optimizer's ``step``), FP8 tensors and their scales (their values mean nothing without
    each other; see :mod:`reshard_svc.plan.quant`) and names matching a ``keep`` glob keep
    their dtype; integer and bool tensors are never cast. With ``dequantize_to``, FP8
    tensors (all paired with their scales, which the caller dropped) become that dtype and
    are counted apart. A ``keep`` glob that matches no tensor is a typo."""
    for glob in keep or ():
        if not any(fnmatch.fnmatchcase(n, glob) for n in index.tensors):
            raise UsageError(f"--keep-dtype {glob!r} matches no tensor")
    out: dict[str, torch.dtype] = {}
    cast = kept = 0
    scales = scale_tensors(index.tensors)
    for name, meta in index.tensors.items():
        out[name] = meta.dtype
        if dequantize_to is not None and is_fp8(meta.dtype):
            out[name] = dequantize_to
            continue
        if dtype is None or not meta.dtype.is_floating_point:
            continue
        if (
            not meta.shape
            or is_fp8(meta.dtype)
            or name in scales
            or any(fnmatch.fnmatchcase(name, g) for g in keep or ())
        ):
            kept += 1
        else:
            out[name] = dtype
            cast += 1
    return out, cast, kept
