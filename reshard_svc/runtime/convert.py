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
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc._collector import collector_paused
from reshard_svc._version import __version__
from reshard_svc.errors import LayoutError, UsageError
from reshard_svc.format.checksums import DEFAULT_BLOCK_SIZE, check_algorithm
from reshard_svc.format.collect import TargetRun
from reshard_svc.format.index import CheckpointIndex, FileMeta, TensorMeta
from reshard_svc.format.safetensors import dtype_from_name
from reshard_svc.format.sources import HF_INDEX
from reshard_svc.layout import Box, Mesh
from reshard_svc.plan.output import (
    DEFAULT_SHARD_SIZE,
    OutputPlan,
    plan_hf,
    plan_native,
    target_bands,
)
from reshard_svc.plan.read import ReadPlan, StorageCost, choose_plan, warn_if_over_budget
from reshard_svc.plan.rules import resolve_layouts, select_tensors
from reshard_svc.plan.spec import parse_dtype, parse_size
from reshard_svc.runtime.buffers import BackgroundWriter, BufferPool
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.executor import Progress, execute
from reshard_svc.runtime.load import open_shared
from reshard_svc.runtime.reading import StorageSource
from reshard_svc.runtime.writers import BandSink, FileWriter, copy_blobs
from reshard_svc.storage import open_storage

__all__ = ["ConvertResult", "DEFAULT_SHARD_SIZE", "convert", "parse_size"]

logger = logging.getLogger(__name__)

DEFAULT_CONVERT_MEMORY = 1024**3


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
    conversion = Conversion(
        src, dst, mesh=mesh, rules=rules, format=format, dtype=dtype, strategy=strategy,
        max_memory=max_memory, max_shard_size=max_shard_size, process_group=process_group,
        storage_options=storage_options, checksum=checksum, overwrite=overwrite, only=only,
        strip_prefix=strip_prefix,
    )  # fmt: skip
    with collector_paused():  # see reshard_svc._collector: no full collection mid-run
        return conversion.run(progress)


class Conversion:
    """One conversion on this worker, as named steps. Every step that can fail runs
    through ``comm.run_everywhere``, so all workers fail together and none is left in a
    collective its peers abandoned; any failure before the commit drops the staging data.
    """

    def __init__(
        self,
        src: str,
        dst: str,
        *,
        mesh: Mesh | str | None,
        rules: str | Mapping[str, Any] | None,
        format: str,
        dtype: str | torch.dtype | None,
        strategy: str,
        max_memory: int | str | None,
        max_shard_size: int | str | None,
        process_group: Any,
        storage_options: Mapping[str, Any] | None,
        checksum: str | bool,
        overwrite: bool,
        only: Sequence[str] | None,
        strip_prefix: str | None,
    ) -> None:
        self.algorithm = check_algorithm(checksum)
        if format not in ("native", "hf"):
            raise UsageError(f"format must be 'native' or 'hf', got {format!r}")
        if strategy not in ("auto", "exchange", "direct"):
            raise UsageError(f"strategy must be auto, exchange or direct, got {strategy!r}")
        self.src, self.dst, self.mesh, self.rules = src, dst, mesh, rules
        self.format, self.strategy, self.overwrite = format, strategy, overwrite
        self.budget = parse_size(max_memory, "max_memory") or DEFAULT_CONVERT_MEMORY
        self.shard_cap = parse_size(max_shard_size, "max_shard_size") or DEFAULT_SHARD_SIZE
        self.out_dtype = _cast_dtype(dtype)
        self.comm = Comm(process_group)
        self.storage_options, self.only, self.strip_prefix = storage_options, only, strip_prefix
        self.run_: TargetRun | None = None
        self.writers: dict[str, FileWriter] = {}

    def run(self, progress: Progress | None) -> ConvertResult:
        self.open()
        try:
            out, plan, where, chosen = self.plan()
        except BaseException:
            self.abort()
            raise
        background = BackgroundWriter(max(1, self.budget // 4))
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
            index, chosen, bytes_read, sum(r[0] for r in results), plan.bytes_exchanged(),
            sum(f.size for f in index.files.values()), len(plan.waves),
        )  # fmt: skip

    # ---- steps

    def open(self) -> None:
        """Open the source (rank 0 reads its index, all share it) and the target; rank 0
        checks the target and takes its lease."""
        self.storage, index = open_shared(self.src, self.comm, self.storage_options)
        self.index = select_tensors(index, self.only, self.strip_prefix)
        self.target = open_storage(self.dst, self.storage_options)
        if self.target.uri.rstrip("/") == self.storage.uri.rstrip("/"):
            raise LayoutError("source and target are the same folder: convert into a new target")

        def prepare() -> dict[str, Any]:
            native = self.format == "native"
            self.layouts = resolve_layouts(self.index, self.mesh, self.rules) if native else {}
            if self.comm.rank == 0:
                self.run_ = TargetRun(self.target, "convert", self.overwrite)
                return {"token": self.run_.token}
            return {"token": ""}

        try:
            _, infos = self.comm.run_everywhere("convert: planning target layouts", prepare)
        except BaseException:
            if self.run_ is not None:  # another rank failed: give the target back
                self.run_.abort(self.target.staging(self.run_.token))
            raise
        self.token = infos[0]["token"]
        self.staging = self.target.staging(self.token)

    def plan(self) -> tuple[OutputPlan, ReadPlan, dict[tuple[str, Box], tuple[str, int]], str]:
        """The output plan, where each target band lands, and the read plan (``auto``:
        the cheaper strategy for this source storage)."""
        # A cast applies to floating-point tensors; integer and bool tensors (step
        # counters, masks) keep their dtype.
        self.dtypes = {
            n: self.out_dtype if self.out_dtype is not None and m.dtype.is_floating_point
            else m.dtype
            for n, m in self.index.tensors.items()
        }  # fmt: skip
        world = self.comm.world
        if self.format == "native":
            suffix = self.staging.file_suffix
            out = plan_native(self.index, self.layouts, self.dtypes, world, self.token, suffix)
        else:
            out = plan_hf(self.index, self.dtypes, world, self.shard_cap)
        wanted, where = target_bands(out, self.index, self.budget)
        warn_if_over_budget(self.index, wanted, self.budget)
        plan = choose_plan(
            self.index, wanted, world, self.budget, self.strategy, StorageCost.of(self.storage)
        )
        chosen = plan.strategy
        logger.info("convert %s -> %s: %s strategy, %d waves", self.src, self.dst, chosen,
                    len(plan.waves))  # fmt: skip
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
        sink = BandSink(
            plan, self.dtypes, where, self.writers, BufferPool(max(1, self.budget // 2))
        )

        def open_writers() -> None:
            for spec in out.files:
                if spec.writer == self.comm.rank:
                    self.writers[spec.name] = FileWriter(
                        self.staging, spec, background, self.algorithm
                    )

        self.comm.run_everywhere("convert: opening output files", open_writers)
        source = StorageSource(
            self.storage, {n: m.dtype for n, m in self.index.tensors.items()}, self.comm.rank,
            self.index.block_tables(), check_in_place=False,
        )  # fmt: skip
        bytes_read = execute(plan, source, self.comm, sink, progress=progress)

        def close_all() -> list[Any]:
            background.drain()
            return [bytes_read, [w.close() for w in self.writers.values()]]

        _, results = self.comm.run_everywhere("convert: closing output files", close_all)
        return bytes_read, results

    def result_index(self, out: OutputPlan, results: list[Any]) -> CheckpointIndex:
        block_size = DEFAULT_BLOCK_SIZE if self.algorithm != "none" else None
        files = {
            name: FileMeta.from_written(name, size, sums, block_size)
            for r in results
            for name, size, sums in r[1]
        }
        return CheckpointIndex(
            tensors={
                n: TensorMeta(n, self.dtypes[n], m.shape, out.layouts.get(n), out.chunks.get(n, ()))
                for n, m in self.index.tensors.items()
            },
            files=files,
            extras=dict(self.index.extras),
            created_by=f"reshard_svc {__version__}",
            checksum=self.algorithm,
            block_size=block_size,
        )

    def commit(self, out: OutputPlan, result: CheckpointIndex) -> None:
        """Rank 0: copy opaque items, write the HF index if any, commit the index last."""
        run = self.run_
        if run is None:
            return
        staging, index = self.staging, self.index
        try:
            if index.blobs and self.format == "native":
                name = f"opaque{staging.file_suffix}.bin"
                meta, blobs = copy_blobs(index, self.storage, staging, name, self.algorithm)
                result.files[name] = meta
                result.blobs = blobs
            elif index.blobs:
                logger.warning(
                    "an HF folder holds tensors only: %d opaque item(s) (e.g. %r) not exported",
                    len(index.blobs), next(iter(index.blobs)),
                )  # fmt: skip
            result.check()
            if self.format == "hf":
                weight_map = {n: spec.name for spec in out.files for n, _ in spec.entries}
                total = sum(m.nbytes for m in result.tensors.values())
                hf_index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                staging.write(HF_INDEX, json.dumps(hf_index, indent=2).encode())
        except BaseException:
            run.abort(staging)
            raise
        run.commit(staging, result.dumps())

    def abort(self) -> None:
        if self.run_ is not None:
            self.run_.abort(self.staging)
