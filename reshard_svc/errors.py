"""The one error hierarchy of reshard_svc.

Every error this library raises on purpose derives from :class:`ReshardError`::

    ReshardError
    ├── UsageError (ValueError)           a bad argument or option value (size, dtype, ...)
    ├── LayoutError (ValueError)          bad mesh, placements, shape or rule text
    ├── StateDictError (ValueError)       unsupported values, missing keys, keys that differ
    │   └── ReplicaMismatchError          two ranks hold different bytes for one box
    ├── CheckpointError                   the checkpoint on storage is not usable
    │   ├── NotACheckpointError           no committed index at that URI
    │   ├── TargetExistsError             a save would replace a checkpoint (no overwrite)
    │   ├── TargetBusyError               another run holds the target's lease
    │   ├── SaveFailedError               a background save failed (``step`` names it)
    │   ├── TornSnapshotError             a tensor changed in place before its copy finished
    │   ├── UnsupportedFormatError        unknown format version
    │   ├── CorruptCheckpointError        malformed file, bad header, bad block table
    │   │   └── ChecksumError             bytes read fail their CRC32C (file, range, values)
    │   └── InconsistentIndexError        overlapping / missing chunks, shape or dtype mismatch
    ├── UnsafePickleError                 a DCP pickle names a global outside the allow-list
    ├── BufferReuseError                  a buffer was written after its owner released it
    ├── StorageError (OSError)            the storage backend failed; ``__cause__`` is kept
    │   └── MissingFileError (FileNotFoundError)
    ├── PathNotAllowedError (PermissionError)  a URI outside the configured roots
    ├── TransferError (ValueError)        a live transfer's two sides do not match
    └── DistributedError                  a peer rank failed; carries the peers' messages
        └── TransferAbortedError          a transfer failed mid-way; says what was updated
            └── EngineFencedError         a failed push could not be undone on this rank

Messages name the thing to fix (the key, the file, the flag), never just "invalid".
"""

from __future__ import annotations

__all__ = [
    "BufferReuseError",
    "CheckpointError",
    "ChecksumError",
    "CorruptCheckpointError",
    "DistributedError",
    "EngineFencedError",
    "InconsistentIndexError",
    "LayoutError",
    "MissingFileError",
    "NotACheckpointError",
    "PathNotAllowedError",
    "ReplicaMismatchError",
    "ReshardError",
    "SaveFailedError",
    "StateDictError",
    "StorageError",
    "TargetBusyError",
    "TargetExistsError",
    "TornSnapshotError",
    "TransferAbortedError",
    "TransferError",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "UsageError",
]


class ReshardError(Exception):
    """Base of every error reshard_svc raises on purpose."""


class BufferReuseError(ReshardError):
    """A buffer was written after its owner released it (``RESHARD_DEBUG_BUFFERS=1``): a
    bug in reshard_svc, never bad input. ``buffer`` names it."""

    def __init__(self, message: str, *, buffer: str = "") -> None:
        super().__init__(message)
        self.buffer = buffer


class UsageError(ReshardError, ValueError):
    """An argument or option value the caller must fix (a size, a dtype, a strategy)."""


class LayoutError(ReshardError, ValueError):
    """A mesh, placement, layout or shape that cannot describe a sharded tensor."""


class StateDictError(ReshardError, ValueError):
    """A state dict value or key that save/load cannot handle."""


class ReplicaMismatchError(StateDictError):
    """Ranks that hold the same box of a tensor hold different bytes (replicas that do not
    agree). ``tensor`` names it and ``ranks`` are the ranks that hold it."""

    def __init__(self, message: str, *, tensor: str = "", ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.tensor, self.ranks = tensor, tuple(ranks)


class CheckpointError(ReshardError):
    """The checkpoint at a URI cannot be used as it is."""


class NotACheckpointError(CheckpointError):
    """No committed checkpoint (``reshard.index.json``) at the URI."""


class TargetExistsError(CheckpointError):
    """The target holds a committed checkpoint and ``overwrite`` was not given."""


class TargetBusyError(CheckpointError):
    """Another run holds the target's lease (a save or convert in progress); ``holder``
    says who (its job or host and pid) and ``age`` how long it has run (seconds)."""

    def __init__(self, message: str, *, holder: str = "", age: float = 0.0) -> None:
        super().__init__(message)
        self.holder, self.age = holder, age


class SaveFailedError(CheckpointError):
    """A checkpoint manager's background save failed (disk full, storage down, lease lost);
    raised on every rank at the next ``save``/``wait``/``close``. ``step`` is the step that
    was not committed; ``failures`` maps rank to its error text."""

    def __init__(self, message: str, step: int, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.failures: dict[int, str] = dict(failures or {})


class TornSnapshotError(CheckpointError):
    """A background save's snapshot is not one moment of training: ``tensors`` changed in
    place (``optimizer.step``) before their copies finished, so nothing was written. A
    :class:`~reshard_svc.CheckpointManager` makes that step not count, with a warning; pass
    it ``optimizers=[...]`` so each step waits for the copies."""

    def __init__(self, message: str, tensors: list[str] | None = None) -> None:
        super().__init__(message)
        self.tensors = list(tensors or [])


class UnsupportedFormatError(CheckpointError):
    """The checkpoint was written in a format version this release cannot read."""


class CorruptCheckpointError(CheckpointError):
    """A data file is malformed, truncated, missing, or fails its checksum."""


class ChecksumError(CorruptCheckpointError):
    """Bytes read from a data file do not match their recorded CRC32C.

    ``file``, ``begin``/``end`` (the byte range) and ``expected``/``actual`` (hex) say where.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str = "",
        begin: int = 0,
        end: int = 0,
        expected: str = "",
        actual: str = "",
    ) -> None:
        super().__init__(message)
        self.file, self.begin, self.end = file, begin, end
        self.expected, self.actual = expected, actual


class InconsistentIndexError(CheckpointError):
    """The index contradicts itself: overlaps, gaps, or mismatched shapes/dtypes."""


class UnsafePickleError(ReshardError):
    """A pickle asked for a global that the allow-listed unpickler refuses."""


class StorageError(ReshardError, OSError):
    """The storage backend failed. The original exception is ``__cause__``."""


class MissingFileError(StorageError, FileNotFoundError):
    """A file the operation needs does not exist."""


class PathNotAllowedError(ReshardError, PermissionError):
    """A URI lies outside the roots this process may touch."""


class DistributedError(ReshardError):
    """One or more ranks failed; ``failures`` maps rank to its error text."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})


class TransferError(ReshardError, ValueError):
    """The two sides of a live transfer do not match: a missing or unused name, a shape or
    dtype that differs, sources that do not tile, a budget too small. Raised on every rank
    before any byte moves."""


class TransferAbortedError(DistributedError):
    """A rank failed during a transfer. ``updated`` names the target tensors that were
    swapped in whole before the failure; every other target is untouched."""

    def __init__(
        self,
        message: str,
        failures: dict[int, str] | None = None,
        *,
        updated: tuple[str, ...] = (),
        untouched: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message, failures)
        self.updated, self.untouched = tuple(updated), tuple(untouched)


class EngineFencedError(TransferAbortedError):
    """A weight-sync push failed and this rank's targets could not be put back to the
    last committed version (its undo journal outgrew ``undo_memory``). The engine on this
    rank must not serve: ``sync.version`` is None and the session's next push sends it
    whole pieces (refills it)."""
