"""The pure plans of ``convert``: what the output holds (files, headers, chunk byte
ranges, one writer worker per file) and where each target band lands. Every worker
computes the same answers; nothing here does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reshard_svc.format.index import CheckpointIndex, Chunk
from reshard_svc.format.safetensors import dtype_name, encode_header, itemsize
from reshard_svc.layout import Box, Layout
from reshard_svc.plan.budget import Budget
from reshard_svc.plan.items import Held, Holdings
from reshard_svc.plan.read import row_step, split_rows
from reshard_svc.plan.save import FileSpec, plan_save

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "OutputPlan",
    "plan_hf",
    "plan_native",
    "target_bands",
]

DEFAULT_SHARD_SIZE = 5 * 1000**3  # HF's default max_shard_size


@dataclass(frozen=True, kw_only=True)
class OutputPlan:
    files: tuple[FileSpec, ...]  # FileSpec.writer is the worker rank
    chunks: dict[str, tuple[Chunk, ...]]
    layouts: dict[str, Layout | None]
    dtypes: dict[str, torch.dtype]


def assign_files(files: list[FileSpec], workers: int) -> list[FileSpec]:
    """Each output file gets one writer worker: runs of consecutive files (in name order,
    which is mesh-rank order) go to the same worker, cut where the largest worker's bytes
    are the smallest a contiguous split allows (deterministic).

    Neighbouring target ranks come from the same source ranks (TP=2 -> TP=4: targets 0
    and 1 are halves of source 0), so a worker reads each source byte it needs once; an
    interleaved assignment would have both workers read every column-split source band.
    """
    ordered = sorted(files, key=lambda f: f.name)
    sizes = [f.size for f in ordered]

    def cut(cap: int) -> list[int]:
        """Worker of each file, filling each worker up to ``cap`` bytes in order."""
        owner, w, load = [], 0, 0
        for n in sizes:
            if load and load + n > cap:
                w, load = w + 1, 0
            owner.append(w)
            load += n
        return owner

    lo, hi = max(sizes, default=0), sum(sizes)
    while lo < hi:  # the smallest cap that needs at most `workers` runs
        mid = (lo + hi) // 2
        if (cut(mid)[-1] if sizes else 0) < workers:
            hi = mid
        else:
            lo = mid + 1
    return [
        FileSpec(name=f.name, writer=w, entries=f.entries, header=f.header, size=f.size)
        for f, w in zip(ordered, cut(lo), strict=True)
    ]


def plan_native(
    index: CheckpointIndex,
    layouts: dict[str, Layout],
    dtypes: dict[str, torch.dtype],
    workers: int,
    token: str,
    suffix: str,
) -> OutputPlan:
    world = max((lay.mesh.size for lay in layouts.values()), default=1)
    holdings = {
        name: Holdings(
            dtype=dtype_name(dtypes[name]),
            itemsize=itemsize(dtypes[name]),
            shape=meta.shape,
            held=tuple(
                Held(box=it.box, holders=it.holders) for it in layouts[name].write_items(meta.shape)
            ),
        )
        for name, meta in index.tensors.items()
    }
    plan = plan_save(holdings, world, token=token, file_suffix=suffix)
    return OutputPlan(
        files=tuple(assign_files(list(plan.files), workers)),
        chunks=plan.chunks,
        layouts=dict(layouts),
        dtypes=dtypes,
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
                (Chunk(box=Box((0,) * len(shape), shape), file=fname, begin=b, end=e),)
                if math.prod(shape)
                else ()
            )
            end = max(end, e)
        full = tuple(
            (n, Box((0,) * len(index.tensors[n].shape), index.tensors[n].shape)) for n in names
        )
        files.append(FileSpec(name=fname, writer=0, entries=full, header=header, size=end))
    return OutputPlan(
        files=tuple(assign_files(files, workers)),
        chunks=chunks,
        layouts=dict.fromkeys(index.tensors),
        dtypes=dtypes,
    )


def target_bands(
    out: OutputPlan, index: CheckpointIndex, budget: Budget
) -> tuple[dict[str, list[Held]], dict[tuple[str, Box], tuple[str, int]]]:
    """Target boxes cut on the read plan's row grid, each with its writer, and where each
    band lands: (file, byte offset)."""
    writer_of = {f.name: f.writer for f in out.files}
    wanted: dict[str, list[Held]] = {}
    where: dict[tuple[str, Box], tuple[str, int]] = {}
    for name, chunks in out.chunks.items():
        meta = index.tensors[name]
        step = row_step(meta.shape, meta.itemsize, budget.band)
        osz = itemsize(out.dtypes[name])
        bands: list[Held] = []
        for c in chunks:
            row = math.prod(c.box.sizes[1:]) * osz if c.box.ndim else 0
            for band in split_rows(c.box, step):
                off = (band.offsets[0] - c.box.offsets[0]) * row if band.ndim else 0
                where[(name, band)] = (c.file, c.begin + off)
                bands.append(Held(box=band, holders=(writer_of[c.file],)))
        wanted[name] = bands
    return wanted, where
