"""Describe state-dict tensors as boxes held by process-group ranks, and reach their data.

Shared by save (where the data comes from) and load (where it goes): a DTensor's boxes
come from its layout and mesh, a plain tensor is one whole box on every rank, and a legacy
ShardedTensor lists its shards explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from reshard_svc import _compat
from reshard_svc.errors import StateDictError
from reshard_svc.layout import Box, Layout, local_slices
from reshard_svc.runtime.comm import Comm
from reshard_svc.state_dict import Leaf

__all__ = ["Placed", "describe"]


@dataclass
class Placed:
    """A tensor leaf: global metadata, distinct boxes with holders, and this rank's views."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout | None
    boxes: list[tuple[Box, tuple[int, ...]]]
    local: dict[Box, torch.Tensor] = field(default_factory=dict)

    def signature(self) -> list[object]:
        return [
            self.name,
            str(self.dtype),
            list(self.shape),
            str(self.layout) if self.layout else None,
            [[list(b.offsets), list(b.sizes), list(h)] for b, h in self.boxes],
        ]


def describe(leaf: Leaf, comm: Comm) -> Placed:
    """The boxes of one tensor leaf, with this rank's local views of the boxes it holds."""
    value = leaf.value
    if leaf.kind == "dtensor":
        layout = _compat.layout_of(value)
        shape = tuple(int(s) for s in value.shape)
        mesh_ranks = [comm.group_rank(r) for r in _compat.mesh_global_ranks(value.device_mesh)]
        boxes = [
            (it.box, tuple(mesh_ranks[h] for h in it.holders)) for it in layout.write_items(shape)
        ]
        placed = Placed(leaf.name, value.dtype, shape, layout, boxes)
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
        boxes = []
        for sm in md.shards_metadata:
            box = Box(tuple(sm.shard_offsets), tuple(sm.shard_sizes))
            if not box.is_empty:
                boxes.append((box, (comm.group_rank(sm.placement.rank()),)))
        placed = Placed(leaf.name, md.tensor_properties.dtype, shape, None, boxes)
        for shard in value.local_shards():
            box = Box(tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
            if not box.is_empty:
                placed.local[box] = shard.tensor
        return placed
    if leaf.kind == "tensor":
        t: torch.Tensor = value
        shape = tuple(t.shape)
        full = Box((0,) * t.dim(), shape)
        boxes = [(full, tuple(range(comm.world)))] if math.prod(shape) else []
        placed = Placed(leaf.name, t.dtype, shape, None, boxes)
        if boxes:
            placed.local[full] = t
        return placed
    raise StateDictError(f"{leaf.name!r} is not a tensor")
