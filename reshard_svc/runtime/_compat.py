"""The one module that touches torch's private or version-sensitive distributed APIs.

Everything else in reshard_svc speaks :mod:`reshard_svc.layout`; this module converts
to and from torch placements, ``DeviceMesh`` and ``DTensor``, and wraps the private
helpers used as an oracle in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reshard_svc.errors import LayoutError
from reshard_svc.layout import Layout, Mesh, Placement, Replicate, Shard, StridedShard

__all__ = [
    "dtensor_cls",
    "from_torch_placements",
    "is_dtensor",
    "is_sharded_tensor",
    "layout_of",
    "mesh_of",
    "to_torch_placements",
    "torch_local_shape_and_offset",
]


def dtensor_cls() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(value: Any) -> bool:
    try:
        return isinstance(value, dtensor_cls())
    except ImportError:  # pragma: no cover - torch built without distributed
        return False


def is_sharded_tensor(value: Any) -> bool:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, ShardedTensor)


def to_torch_placements(placements: Sequence[Placement]) -> tuple[Any, ...]:
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for p in placements:
        if isinstance(p, Replicate):
            out.append(TReplicate())
        elif isinstance(p, StridedShard):
            out.append(_StridedShard(p.dim, split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(TShard(p.dim))
        else:
            raise LayoutError(f"unknown placement {p!r}")
    return tuple(out)


def from_torch_placements(placements: Sequence[Any]) -> tuple[Placement, ...]:
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Placement] = []
    for p in placements:
        if isinstance(p, _StridedShard):
            out.append(StridedShard(int(p.dim), int(p.split_factor)))
        elif isinstance(p, TShard):
            out.append(Shard(int(p.dim)))
        elif isinstance(p, TReplicate):
            out.append(Replicate())
        else:
            # Partial (pending reductions) has no stored form: reduce before saving.
            raise LayoutError(
                f"placement {p} cannot be saved: redistribute to Replicate or Shard first"
            )
    return tuple(out)


def mesh_of(device_mesh: Any) -> Mesh:
    names = getattr(device_mesh, "mesh_dim_names", None)
    return Mesh(tuple(int(s) for s in device_mesh.shape), tuple(names) if names else None)


def layout_of(dtensor: Any) -> Layout:
    """The :class:`Layout` of a DTensor (its mesh shape and placements)."""
    return Layout(mesh_of(dtensor.device_mesh), from_torch_placements(dtensor.placements))


def mesh_rank_of(device_mesh: Any) -> int | None:
    """This process's flat index inside ``device_mesh`` (row-major), or None if outside."""
    coord = device_mesh.get_coordinate()
    if coord is None:
        return None
    return mesh_of(device_mesh).rank_of(coord)


def torch_local_shape_and_offset(
    layout: Layout, global_shape: Sequence[int], coordinate: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's own answer, for tests: local shape and global offset of one coordinate."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = to_torch_placements(layout.normalized(len(global_shape)))
    shape, offset = _compute_local_shape_and_global_offset(
        tuple(global_shape), layout.mesh.shape, list(coordinate), placements
    )
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)
