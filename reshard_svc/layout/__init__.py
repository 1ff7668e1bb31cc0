"""The layout core: pure geometry, no process group, no I/O, no torch.

:class:`Box` (a hyper-rectangle of a global tensor) and the interval sweep that
intersects two box lists (:mod:`.box`); :class:`Mesh` (:mod:`.mesh`); the placements
``Replicate``, ``Shard(d)`` and ``StridedShard(d, k)`` (:mod:`.placements`); and
:class:`Layout`, which gives every mesh coordinate its boxes and every distinct box its
holders and one writer, exactly as torch's DTensor does (:mod:`.sharding`).
"""

from reshard_svc.layout.box import Box, Overlap, check_tiling, overlaps
from reshard_svc.layout.mesh import MAX_MESH_SIZE, Mesh
from reshard_svc.layout.placements import (
    Placement,
    Replicate,
    Shard,
    StridedShard,
    parse_placement,
    parse_placements,
    split_top_level,
)
from reshard_svc.layout.sharding import Layout, WriteItem, choose_writers, local_slices

__all__ = [
    "MAX_MESH_SIZE",
    "Box",
    "Layout",
    "Mesh",
    "Overlap",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "WriteItem",
    "check_tiling",
    "choose_writers",
    "local_slices",
    "overlaps",
    "parse_placement",
    "parse_placements",
    "split_top_level",
]
