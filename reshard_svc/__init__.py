"""reshard_svc: save, load and reshard PyTorch distributed checkpoints between meshes.

The layout core (:mod:`reshard_svc.layout`, :mod:`reshard_svc.boxes`) is pure and needs
no process group; the runtime (``save``, ``load``, ``convert``) runs under torchrun.
"""

from reshard_svc.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DistributedError,
    InconsistentIndexError,
    LayoutError,
    NotACheckpointError,
    PathNotAllowedError,
    ReshardError,
    StateDictError,
    StorageError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from reshard_svc.layout import Box, Layout, Mesh, Replicate, Shard, StridedShard, WriteItem

__version__ = "0.1.0"

__all__ = [
    "Box",
    "CheckpointError",
    "CorruptCheckpointError",
    "DistributedError",
    "InconsistentIndexError",
    "Layout",
    "LayoutError",
    "Mesh",
    "NotACheckpointError",
    "PathNotAllowedError",
    "Replicate",
    "ReshardError",
    "Shard",
    "StateDictError",
    "StorageError",
    "StridedShard",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "WriteItem",
    "__version__",
]
