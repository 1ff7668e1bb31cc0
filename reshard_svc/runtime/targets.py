"""Describe state-dict tensors as boxes held by ranks, gather who holds what, and check
that replicas agree. Shared by ``save`` (where data comes from), ``load`` (where it goes)
and ``transfer`` (both).

A tensor is described by the ranks that pass it, not by the world: pipeline stages pass
different keys, a DTensor may live on any sub-mesh, and a :class:`LocalShard` says where
it sits. Each rank describes only what it holds — a DTensor's boxes from its layout and
mesh coordinate, a plain tensor as one whole box, a legacy ShardedTensor from its local
shards, a LocalShard from its offsets — and :func:`gather` (one all-gather of JSON) gives
every rank the same :class:`~reshard_svc.plan.items.Holdings` of every tensor. Where
several ranks hold one box, those are replicas: :func:`check_replicas` compares their
CRC32Cs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch

from reshard_svc.errors import ReplicaMismatchError, StateDictError
from reshard_svc.layout import Box, Layout, local_slices
from reshard_svc.plan.items import Held, Holdings
from reshard_svc.runtime import _compat
from reshard_svc.runtime.buffers import tensor_bytes
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.ring import pinned_ring
from reshard_svc.runtime.state_dict import Leaf, LocalShard, LocalShards

__all__ = [
    "Gathered",
    "Placed",
    "box_crc",
    "check_replicas",
    "describe",
    "gather",
]

#: Rows copied at a time when a strided view is checksummed.
_BAND_BYTES = 64 * 1024 * 1024


@dataclass(kw_only=True)
class Placed:
    """A tensor leaf on this rank: its global metadata and this rank's views of the boxes
    it holds (a :class:`LocalShard` target also lists its padding, to fill)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout | None
    local: dict[Box, torch.Tensor] = field(default_factory=dict)
    padding: list[torch.Tensor] = field(default_factory=list)
    pad: float = 0

    def describe(self) -> list[Any]:
        """This rank's description, as :func:`gather` sends it."""
        return [
            str(self.dtype).removeprefix("torch."),
            self.dtype.itemsize,
            list(self.shape),
            str(self.layout) if self.layout else None,
            [[list(b.offsets), list(b.sizes)] for b in sorted(self.local)],
        ]

    def fill_padding(self) -> None:
        for slab in self.padding:
            slab.fill_(self.pad)


def describe(leaf: Leaf) -> Placed:
    """The global metadata of one tensor leaf and this rank's views of the boxes it holds."""
    value = leaf.value
    if leaf.kind == "local":
        shard: LocalShard = value
        t = shard.data
        placed = Placed(
            name=leaf.name, dtype=t.dtype, shape=shard.global_shape, layout=None, pad=shard.pad
        )
        if t.numel():
            placed.local[Box(shard.offsets, tuple(t.shape))] = t
        placed.padding = shard.padding()
        return placed
    if leaf.kind == "locals":
        shards: LocalShards = value
        first = shards.shards[0]
        placed = Placed(
            name=leaf.name,
            dtype=first.tensor.dtype,
            shape=first.global_shape,
            layout=None,
            pad=first.pad,
        )
        for s in shards.shards:
            if s.data.numel():
                placed.local[Box(s.offsets, tuple(s.data.shape))] = s.data
            placed.padding += s.padding()
        return placed
    if leaf.kind == "dtensor":
        layout = _compat.layout_of(value)
        shape = tuple(int(s) for s in value.shape)
        placed = Placed(name=leaf.name, dtype=value.dtype, shape=shape, layout=layout)
        me = _compat.mesh_rank_of(value.device_mesh)
        if me is not None:
            mine = layout.rank_boxes(shape, me)
            local = value.to_local()
            for box, where in zip(mine, local_slices(mine)):
                if not box.is_empty:
                    placed.local[box] = local[where]
        return placed
    if leaf.kind == "sharded":
        md = value.metadata()
        shape = tuple(int(s) for s in md.size)
        placed = Placed(name=leaf.name, dtype=md.tensor_properties.dtype, shape=shape, layout=None)
        for s in value.local_shards():
            box = Box(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))
            if not box.is_empty:
                placed.local[box] = s.tensor
        return placed
    if leaf.kind == "tensor":
        whole: torch.Tensor = value
        shape = tuple(whole.shape)
        placed = Placed(name=leaf.name, dtype=whole.dtype, shape=shape, layout=None)
        if math.prod(shape):
            placed.local[Box((0,) * whole.dim(), shape)] = whole
        return placed
    raise StateDictError(f"{leaf.name!r} is not a tensor")


@dataclass(frozen=True)
class Gathered:
    """What :func:`gather` returns on every rank: this rank's own described tensors per
    side, every side's holdings (the same on every rank), and each rank's ``extra``."""

    mine: dict[str, dict[str, Placed]]
    holdings: dict[str, dict[str, Holdings]]
    extras: list[Any]


def gather(
    comm: Comm,
    what: str,
    describe_sides: Callable[[], tuple[Mapping[str, Mapping[str, Placed]], Any]],
) -> Gathered:
    """Every rank: describe its tensors and learn every side's holdings, in one all-gather.

    ``describe_sides()`` returns (side name -> tensor name -> :class:`Placed`, any JSON
    the caller wants from every rank). Collective. A failure describing on any rank raises
    on every rank. The same name passed with different dtypes, shapes or layouts raises
    :class:`StateDictError` naming the tensor and the ranks.
    """

    def mine() -> tuple[Mapping[str, Mapping[str, Placed]], dict[str, Any]]:
        sides, extra = describe_sides()
        payload = {
            "sides": {
                s: {n: p.describe() for n, p in sorted(ts.items())} for s, ts in sides.items()
            },
            "extra": extra,
        }
        return sides, payload

    (sides, _), everyone = comm.run_everywhere(what, mine, share=lambda r: r[1])
    holdings = {
        side: _holdings(side, [g["sides"].get(side, {}) for g in everyone]) for side in sides
    }
    return Gathered(
        {s: dict(ts) for s, ts in sides.items()}, holdings, [g["extra"] for g in everyone]
    )


def _holdings(side: str, per_rank: list[dict[str, list[Any]]]) -> dict[str, Holdings]:
    meta: dict[str, dict[tuple[Any, ...], list[int]]] = {}
    boxes: dict[str, dict[Box, list[int]]] = {}
    for rank, described in enumerate(per_rank):
        for name, (dtype, itemsize, shape, layout, held) in described.items():
            meta.setdefault(name, {}).setdefault(
                (dtype, itemsize, tuple(shape), layout), []
            ).append(rank)
            for offsets, sizes in held:
                boxes.setdefault(name, {}).setdefault(Box(tuple(offsets), tuple(sizes)), []).append(
                    rank
                )
    out: dict[str, Holdings] = {}
    for name, variants in sorted(meta.items()):
        if len(variants) > 1:
            seen = "; ".join(
                f"{dtype} {list(shape)} {layout or 'no layout'} on rank(s) {_ranks(ranks)}"
                for (dtype, _, shape, layout), ranks in variants.items()
            )
            raise StateDictError(
                f"{side} tensor {name!r} differs between the ranks that pass it ({seen}): the "
                "same key must have one dtype, global shape and layout on every rank"
            )
        (dtype, itemsize, shape, layout), _ = next(iter(variants.items()))
        held = tuple(
            Held(box=b, holders=tuple(rs)) for b, rs in sorted(boxes.get(name, {}).items())
        )
        out[name] = Holdings(dtype=dtype, itemsize=itemsize, shape=shape, held=held, layout=layout)
    return out


def _ranks(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return ", ".join(map(str, rs[:8])) + (f" and {len(rs) - 8} more" if len(rs) > 8 else "")


def box_crc(view: torch.Tensor) -> int:
    """CRC32C of a box's bytes in row-major order (strided views in bands, never whole)."""
    if view.numel() == 0:
        return 0
    view = view.detach()
    if view.dim() == 0 or (view.is_contiguous() and view.device.type == "cpu"):
        return int(crc32c.crc32c(tensor_bytes(view)))
    row = max(1, view[0].numel() * view.element_size())
    step = max(1, _BAND_BYTES // row)
    value = 0
    for i in range(0, view.shape[0], step):
        band = view[i : i + step]
        if band.device.type != "cpu":  # through the pinned ring, never pageable memory
            for data, slot in pinned_ring().pieces(band):
                value = int(crc32c.crc32c(data, value))
                slot.release()
            continue
        value = int(crc32c.crc32c(tensor_bytes(band.contiguous()), value))
    return value


def replicated(holdings: Mapping[str, Holdings]) -> dict[str, list[Box]]:
    """The boxes that two or more ranks hold, per tensor."""
    out: dict[str, list[Box]] = {}
    for name, h in holdings.items():
        boxes = [held.box for held in h.held if len(held.holders) > 1]
        if boxes:
            out[name] = boxes
    return out


def replica_crcs(placed: Mapping[str, Placed], boxes: Mapping[str, list[Box]]) -> dict[str, Any]:
    """This rank's CRC32C of each replicated box it holds: {name: [[offsets, crc], ...]}."""
    out: dict[str, Any] = {}
    for name, bs in boxes.items():
        p = placed.get(name)
        if p is None:
            continue
        mine = [[list(b.offsets), box_crc(p.local[b])] for b in bs if b in p.local]
        if mine:
            out[name] = mine
    return out


def check_replicas(
    boxes: Mapping[str, list[Box]], reports: list[dict[str, Any]], what: str
) -> None:
    """Raise :class:`ReplicaMismatchError` (on every rank: all hold the same ``reports``)
    when two holders of one box reported different CRC32Cs."""
    seen: dict[tuple[str, tuple[int, ...]], dict[int, list[int]]] = {}
    for rank, report in enumerate(reports):
        for name, entries in (report or {}).items():
            for offsets, crc in entries:
                seen.setdefault((name, tuple(offsets)), {}).setdefault(crc, []).append(rank)
    bad = []
    for (name, offsets), by_crc in sorted(seen.items()):
        if len(by_crc) > 1:
            sizes = next(b.sizes for b in boxes[name] if b.offsets == offsets)
            groups = ", ".join(
                f"rank(s) {_ranks(rs)} hold CRC32C {crc:08x}" for crc, rs in sorted(by_crc.items())
            )
            bad.append((name, offsets, sizes, groups))
    if bad:
        name, offsets, sizes, groups = bad[0]
        more = f" (and {len(bad) - 1} more box(es))" if len(bad) > 1 else ""
        raise ReplicaMismatchError(
            f"{what}: replicas of {name!r} {list(offsets)}+{list(sizes)} differ: {groups}"
            f"{more}. Ranks that pass the same key hold copies of one tensor, and copies must "
            "agree: per-rank state needs per-rank keys (e.g. f'experts.{rank}.w') or a "
            "DTensor / LocalShard that says where each rank's part sits",
            tensor=name,
            ranks=tuple(sorted({r for rs in seen[(name, offsets)].values() for r in rs})),
        )
