"""reshard_svc: save, load and reshard PyTorch distributed checkpoints between meshes.

The layout core (:mod:`reshard_svc.layout`, :mod:`reshard_svc.boxes`) is pure and needs
no process group; the runtime (``save``, ``load``, ``convert``, ``transfer``) runs under torchrun.
"""

__version__ = "0.1.0"

from reshard_svc.errors import (  # noqa: E402
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
    TransferAbortedError,
    TransferError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from reshard_svc.index import CheckpointIndex
from reshard_svc.inspection import VerifyReport, inspect, read_blob, verify
from reshard_svc.layout import Box, Layout, Mesh, Replicate, Shard, StridedShard, WriteItem
from reshard_svc.runtime.async_save import AsyncSaver, async_save
from reshard_svc.runtime.convert import ConvertResult, convert
from reshard_svc.runtime.load import LoadStats, load
from reshard_svc.runtime.save import save
from reshard_svc.runtime.transfer import PlanCache, TransferResult, transfer
from reshard_svc.transfer_plan import Cat

__all__ = [
    "AsyncSaver",
    "Box",
    "Cat",
    "CheckpointError",
    "CheckpointIndex",
    "ConvertResult",
    "CorruptCheckpointError",
    "DistributedError",
    "InconsistentIndexError",
    "Layout",
    "LayoutError",
    "LoadStats",
    "Mesh",
    "NotACheckpointError",
    "PathNotAllowedError",
    "PlanCache",
    "Replicate",
    "ReshardError",
    "Shard",
    "StateDictError",
    "StorageError",
    "StridedShard",
    "TransferAbortedError",
    "TransferError",
    "TransferResult",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "VerifyReport",
    "WriteItem",
    "__version__",
    "async_save",
    "convert",
    "inspect",
    "read_blob",
    "load",
    "save",
    "transfer",
    "verify",
]
