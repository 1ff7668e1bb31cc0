"""reshard_svc: save, load and reshard PyTorch distributed checkpoints between meshes.

The packages are layers, each importing only from the ones below it: ``layout`` (pure
geometry), ``storage`` (bytes at a URI), ``format`` (safetensors, checksums, the index,
foreign sources, step folders), ``plan`` (pure plans and budgets), ``jobs`` (the job
contract: ``ConvertSpec`` and its forms, the worker's command line, no torch), ``runtime``
(process groups, the stager and the pools of checking writers, and the one executor:
``save``, ``async_save``, ``load``, ``convert``, ``transfer``) and ``sessions`` (objects
that live across calls: ``CheckpointManager`` with its fast tier, ``WeightSync``); the
torchrun worker (``reshard_svc.worker``) runs a ``ConvertSpec`` on top of them all.
"""

from typing import TYPE_CHECKING

from reshard_svc._version import __version__
from reshard_svc.errors import (
    BufferReuseError,
    CheckpointError,
    ChecksumError,
    CorruptCheckpointError,
    DistributedError,
    EngineFencedError,
    InconsistentIndexError,
    LayoutError,
    MissingFileError,
    NotACheckpointError,
    PathNotAllowedError,
    ReplicaMismatchError,
    ReshardError,
    SaveFailedError,
    StateDictError,
    StorageError,
    TargetBusyError,
    TargetExistsError,
    TornSnapshotError,
    TransferAbortedError,
    TransferError,
    UnsafePickleError,
    UnsupportedFormatError,
    UsageError,
)

#: Public name -> the module that defines it. Imported on first use (PEP 562), so that
#: ``import reshard_svc.jobs.spec`` (the CLI's ``--help``, the client, the control plane)
#: does not pay for importing torch.
_LAZY = {
    "CheckpointIndex": "reshard_svc.format.index",
    "VerifyReport": "reshard_svc.format.inspection",
    "inspect": "reshard_svc.format.inspection",
    "read_blob": "reshard_svc.format.inspection",
    "verify": "reshard_svc.format.inspection",
    "Box": "reshard_svc.layout",
    "Layout": "reshard_svc.layout",
    "Mesh": "reshard_svc.layout",
    "Replicate": "reshard_svc.layout",
    "Shard": "reshard_svc.layout",
    "StridedShard": "reshard_svc.layout",
    "WriteItem": "reshard_svc.layout",
    "AsyncSaver": "reshard_svc.runtime.async_save",
    "async_save": "reshard_svc.runtime.async_save",
    "CheckpointManager": "reshard_svc.sessions.manager",
    "Saved": "reshard_svc.sessions.manager",
    "ConvertResult": "reshard_svc.runtime.convert",
    "convert": "reshard_svc.runtime.convert",
    "LoadStats": "reshard_svc.runtime.load",
    "load": "reshard_svc.runtime.load",
    "save": "reshard_svc.runtime.save",
    "LocalShard": "reshard_svc.runtime.state_dict",
    "LocalShards": "reshard_svc.runtime.state_dict",
    "FastTier": "reshard_svc.sessions.fast",
    "RestoreInfo": "reshard_svc.sessions.fast",
    "PlanCache": "reshard_svc.plan.cache",
    "TransferResult": "reshard_svc.runtime.transfer",
    "transfer": "reshard_svc.runtime.transfer",
    "SyncResult": "reshard_svc.sessions.sync",
    "WeightSync": "reshard_svc.sessions.sync",
    "Cat": "reshard_svc.plan.transfer",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard_svc' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


if TYPE_CHECKING:
    from reshard_svc.format.index import CheckpointIndex
    from reshard_svc.format.inspection import VerifyReport, inspect, read_blob, verify
    from reshard_svc.layout import Box, Layout, Mesh, Replicate, Shard, StridedShard, WriteItem
    from reshard_svc.plan.cache import PlanCache
    from reshard_svc.plan.transfer import Cat
    from reshard_svc.runtime.async_save import AsyncSaver, async_save
    from reshard_svc.runtime.convert import ConvertResult, convert
    from reshard_svc.runtime.load import LoadStats, load
    from reshard_svc.runtime.save import save
    from reshard_svc.runtime.state_dict import LocalShard, LocalShards
    from reshard_svc.runtime.transfer import TransferResult, transfer
    from reshard_svc.sessions.fast import FastTier, RestoreInfo
    from reshard_svc.sessions.manager import CheckpointManager, Saved
    from reshard_svc.sessions.sync import SyncResult, WeightSync

__all__ = [
    "AsyncSaver",
    "Box",
    "Cat",
    "BufferReuseError",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointManager",
    "ChecksumError",
    "ConvertResult",
    "CorruptCheckpointError",
    "DistributedError",
    "EngineFencedError",
    "InconsistentIndexError",
    "Layout",
    "LayoutError",
    "LoadStats",
    "LocalShard",
    "LocalShards",
    "FastTier",
    "RestoreInfo",
    "Mesh",
    "MissingFileError",
    "NotACheckpointError",
    "PathNotAllowedError",
    "PlanCache",
    "ReplicaMismatchError",
    "Replicate",
    "ReshardError",
    "SaveFailedError",
    "Saved",
    "Shard",
    "StateDictError",
    "StorageError",
    "StridedShard",
    "TargetBusyError",
    "TargetExistsError",
    "TornSnapshotError",
    "TransferAbortedError",
    "TransferError",
    "SyncResult",
    "TransferResult",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "UsageError",
    "VerifyReport",
    "WeightSync",
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
