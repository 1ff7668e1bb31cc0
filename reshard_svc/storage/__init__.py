"""Storage backends behind one protocol: ``open_storage(uri)`` picks the backend.

Plain paths and ``file://`` get :class:`LocalStorage` (memory-mapped reads, rename commit);
``s3://`` gets :class:`S3Storage` (uploads carry their CRC32C); every other fsspec protocol
gets :class:`FsspecStorage`. Storage options (endpoints,
credentials) come from the caller or from fsspec's own ``FSSPEC_<PROTOCOL>_*`` env
configuration — never from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec.utils

from reshard_svc.errors import StorageError
from reshard_svc.storage.base import COMMIT_FILE, Committer, LeaseStore, Storage, Target
from reshard_svc.storage.fsspec_store import FsspecStorage
from reshard_svc.storage.local import LocalStorage
from reshard_svc.storage.s3 import S3Storage

__all__ = [
    "COMMIT_FILE",
    "Committer",
    "FsspecStorage",
    "LeaseStore",
    "LocalStorage",
    "S3Storage",
    "Storage",
    "open_storage",
]


def open_storage(uri: str, storage_options: Mapping[str, Any] | None = None) -> Target:
    """The storage for a checkpoint folder URI (``/path``, ``file://``, ``s3://``, ...)."""
    if not isinstance(uri, str) or not uri:
        raise StorageError(f"checkpoint URI must be a non-empty string, got {uri!r}")
    if "::" in uri:
        raise StorageError(f"chained fsspec URLs are not supported: {uri!r}")
    protocol = fsspec.utils.get_protocol(uri)
    if protocol in ("file", "local"):
        return LocalStorage(uri, storage_options=storage_options)
    if protocol in ("s3", "s3a"):
        return S3Storage(uri, storage_options)
    return FsspecStorage(uri, storage_options)
