"""The save plan: which rank writes which box to which file, at which byte offsets.

Pure: computed identically on every rank from the tensors' global metadata, so no plan
needs to be exchanged. Each distinct box is written once, by a byte-balanced choice among
its holders (:func:`reshard_svc.layout.choose_writers`, balanced across all tensors).

A safetensors file holds one key per tensor name, so a rank that writes several boxes of
one tensor (strided shards such as a fused QKV) puts the k-th box of each tensor in its
k-th file. Every file's header — and so every chunk's byte range — is known here, before
any data moves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard_svc.format.index import Chunk
from reshard_svc.format.reader import DCP_SHARDING_INFO, SAVE_TOKEN_KEY
from reshard_svc.format.safetensors import dtype_from_name, encode_header
from reshard_svc.layout import Box, choose_writers
from reshard_svc.plan.items import Holdings

__all__ = ["FileSpec", "SavePlan", "plan_save", "rank_files"]

DCP_VERSION = "1.0"


@dataclass(frozen=True, kw_only=True)
class FileSpec:
    name: str
    writer: int
    entries: tuple[tuple[str, Box], ...]  # (tensor name, box) in data order
    header: bytes
    size: int


@dataclass(frozen=True)
class SavePlan:
    files: tuple[FileSpec, ...]
    chunks: dict[str, tuple[Chunk, ...]]

    def files_of(self, rank: int) -> list[FileSpec]:
        return [f for f in self.files if f.writer == rank]


def plan_save(
    tensors: Mapping[str, Holdings],
    world: int,
    *,
    token: str = "",
    file_suffix: str = "",
    files_per_rank: int = 1,
) -> SavePlan:
    """Plan a save of ``tensors`` (name -> holdings) by ``world`` ranks. Same inputs, same
    plan, on every rank. ``files_per_rank``: a rank's boxes are spread over up to that
    many files of similar size (one per I/O thread, written at once; see
    :func:`rank_files`)."""
    load = [0] * world
    per_rank: dict[int, list[tuple[str, Box]]] = {}
    dtypes = {name: dtype_from_name(t.dtype) for name, t in tensors.items()}
    for name in sorted(tensors):
        t = tensors[name]
        holders = {h.box: h.holders for h in t.held if not h.box.is_empty}
        writers = choose_writers(holders, t.shape, t.itemsize, load)
        for box in sorted(holders):
            per_rank.setdefault(writers[box], []).append((name, box))

    files: list[FileSpec] = []
    chunks: dict[str, list[Chunk]] = {name: [] for name in tensors}
    for rank in sorted(per_rank):
        for spec, placed in rank_files(
            rank,
            per_rank[rank],
            dtypes,
            marked=bool(token),
            file_suffix=file_suffix,
            files=files_per_rank,
        ):
            files.append(spec)
            for n, c in placed:
                chunks[n].append(c)
    return SavePlan(
        tuple(files), {n: tuple(sorted(c, key=lambda c: c.box)) for n, c in chunks.items()}
    )


#: A rank's group of boxes is split over several files only into files at least this big.
MIN_SPLIT_BYTES = 64 * 1024 * 1024


def _split(
    group: list[tuple[str, Box]], dtypes: Mapping[str, Any], files: int
) -> list[list[tuple[str, Box]]]:
    """``group`` cut in order into up to ``files`` runs of similar byte size."""
    sizes = [math.prod(b.sizes) * dtypes[n].itemsize for n, b in group]
    total = sum(sizes)
    parts = min(files, len(group), total // MIN_SPLIT_BYTES)
    if parts <= 1:
        return [group]
    out: list[list[tuple[str, Box]]] = [[]]
    done = 0
    for entry, size in zip(group, sizes):
        if out[-1] and len(out) < parts and done >= total * len(out) / parts:
            out.append([])
        out[-1].append(entry)
        done += size
    return out


def rank_files(
    rank: int,
    entries: list[tuple[str, Box]],
    dtypes: Mapping[str, Any],
    *,
    marked: bool = False,
    file_suffix: str = "",
    files: int = 1,
) -> list[tuple[FileSpec, list[tuple[str, Chunk]]]]:
    """The files rank ``rank`` writes for ``entries`` (tensor, box), in order: the k-th box
    of each tensor in its k-th file (one key per name per file), each header known here,
    with ``DCP_SHARDING_INFO`` as torch's HF writer records it; and where each box lands.
    ``marked`` (a staged save): the header says so. ``files`` > 1: each such group is cut,
    in order, into up to that many files of similar size (none under
    :data:`MIN_SPLIT_BYTES`), so that as many threads can write them at once (writers of
    one file share its lock)."""
    groups: list[list[tuple[str, Box]]] = []
    seen: dict[str, int] = {}
    for name, box in entries:
        k = seen.get(name, 0)
        seen[name] = k + 1
        if k == len(groups):
            groups.append([])
        groups[k].append((name, box))
    groups = [part for group in groups for part in _split(group, dtypes, files)]
    out = []
    for k, group in enumerate(groups):
        fname = f"shard-{rank:05d}-{k:03d}{file_suffix}.safetensors"
        sharding = {n: {"saved_offsets": list(b.offsets)} for n, b in group}
        metadata = {
            DCP_SHARDING_INFO: json.dumps(sharding),
            "DCP_VERSION": DCP_VERSION,
            "format": "pt",
        }
        if marked:
            # A constant marker, not the token, so equal data gives equal bytes.
            metadata[SAVE_TOKEN_KEY] = "1"
        header, ranges = encode_header([(n, dtypes[n], b.sizes) for n, b in group], metadata)
        size = max((e for _, e in ranges.values()), default=len(header))
        placed = [
            (n, Chunk(box=b, file=fname, begin=ranges[n][0], end=ranges[n][1])) for n, b in group
        ]
        out.append(
            (
                FileSpec(name=fname, writer=rank, entries=tuple(group), header=header, size=size),
                placed,
            )
        )
    return out
