"""Describe state-dict tensors as boxes held by process-group ranks, and reach their data.

Shared by save (where the data comes from) and load (where it goes). Each rank describes
only what it holds — a DTensor's boxes from its layout and mesh coordinate, a plain tensor
as one whole box, a legacy ShardedTensor from its local shards — and one all-gather of
those boxes gives every rank the same holder map. That is right for any mesh, including
DTensors on sub-meshes (FSDP2 on a ``dp`` sub-mesh of a 2-D mesh: each ``tp`` column holds
its own replica), where a rank's own mesh does not show the other replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from reshard_svc.errors import StateDictError
from reshard_svc.layout import Box, Layout, local_slices
from reshard_svc.runtime import _compat
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.state_dict import Leaf

__all__ = ["Placed", "describe", "gather_holders"]


@dataclass
class Placed:
    """A tensor leaf: global metadata, this rank's views, and (after
    :func:`gather_holders`) every distinct box with the ranks that hold it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout | None
    local: dict[Box, torch.Tensor] = field(default_factory=dict)
    boxes: list[tuple[Box, tuple[int, ...]]] = field(default_factory=list)

    def signature(self) -> list[object]:
        """What every rank must agree on: name, dtype, shape, layout."""
        return [
            self.name,
            str(self.dtype),
            list(self.shape),
            str(self.layout) if self.layout else None,
        ]


def describe(leaf: Leaf, comm: Comm) -> Placed:
    """The global metadata of one tensor leaf and this rank's views of the boxes it holds."""
    value = leaf.value
    if leaf.kind == "dtensor":
        layout = _compat.layout_of(value)
        shape = tuple(int(s) for s in value.shape)
        placed = Placed(leaf.name, value.dtype, shape, layout)
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
        placed = Placed(leaf.name, md.tensor_properties.dtype, shape, None)
        for shard in value.local_shards():
            box = Box(tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
            if not box.is_empty:
                placed.local[box] = shard.tensor
        return placed
    if leaf.kind == "tensor":
        t: torch.Tensor = value
        shape = tuple(t.shape)
        placed = Placed(leaf.name, t.dtype, shape, None)
        if math.prod(shape):
            placed.local[Box((0,) * t.dim(), shape)] = t
        return placed
    raise StateDictError(f"{leaf.name!r} is not a tensor")


def gather_holders(placed: dict[str, Placed], comm: Comm) -> None:
    """Fill every ``Placed.boxes`` with the distinct boxes and their holder ranks.

    Collective: every rank calls it with the same names (checked). Ranks are numbered in
    ``comm``'s process group.
    """
    mine = {
        name: [[list(b.offsets), list(b.sizes)] for b in sorted(p.local)]
        for name, p in sorted(placed.items())
    }
    everyone = comm.all_gather_json(mine)
    names = [sorted(m) for m in everyone]
    if any(n != names[0] for n in names):
        raise StateDictError(
            "ranks describe different tensors (every rank must pass the same keys); "
            f"rank 0 has {len(names[0])}, others differ"
        )
    holders: dict[str, dict[Box, list[int]]] = {name: {} for name in placed}
    for rank, m in enumerate(everyone):
        for name, boxes in m.items():
            for offs, sizes in boxes:
                holders[name].setdefault(Box(tuple(offs), tuple(sizes)), []).append(rank)
    for name, p in placed.items():
        p.boxes = [(box, tuple(hs)) for box, hs in sorted(holders[name].items())]
