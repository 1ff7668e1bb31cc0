"""The one error hierarchy of reshard_svc.

Every error this library raises on purpose derives from :class:`ReshardError`::

    ReshardError
    ├── LayoutError (ValueError)          bad mesh, placements, shape or rule text
    ├── StateDictError (ValueError)       unsupported values, missing / unexpected keys
    ├── CheckpointError                   the checkpoint on storage is not usable
    │   ├── NotACheckpointError           no committed index at that URI
    │   ├── UnsupportedFormatError        unknown format version
    │   ├── CorruptCheckpointError        malformed file, bad header, checksum mismatch
    │   └── InconsistentIndexError        overlapping / missing chunks, shape or dtype mismatch
    ├── UnsafePickleError                 a DCP pickle names a global outside the allow-list
    ├── StorageError (OSError)            the storage backend failed; ``__cause__`` is kept
    │   └── MissingFileError (FileNotFoundError)
    ├── PathNotAllowedError (PermissionError)  a URI outside the configured roots
    └── DistributedError                  a peer rank failed; carries the peers' messages

Messages name the thing to fix (the key, the file, the flag), never just "invalid".
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "DistributedError",
    "InconsistentIndexError",
    "LayoutError",
    "MissingFileError",
    "NotACheckpointError",
    "PathNotAllowedError",
    "ReshardError",
    "StateDictError",
    "StorageError",
    "UnsafePickleError",
    "UnsupportedFormatError",
]


class ReshardError(Exception):
    """Base of every error reshard_svc raises on purpose."""


class LayoutError(ReshardError, ValueError):
    """A mesh, placement, layout or shape that cannot describe a sharded tensor."""


class StateDictError(ReshardError, ValueError):
    """A state dict value or key that save/load cannot handle."""


class CheckpointError(ReshardError):
    """The checkpoint at a URI cannot be used as it is."""


class NotACheckpointError(CheckpointError):
    """No committed checkpoint (``reshard.index.json``) at the URI."""


class UnsupportedFormatError(CheckpointError):
    """The checkpoint was written in a format version this release cannot read."""


class CorruptCheckpointError(CheckpointError):
    """A data file is malformed, truncated, missing, or fails its checksum."""


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
