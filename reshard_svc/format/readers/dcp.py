"""Read torch DCP ``.distcp`` folders without trusting their pickles.

DCP's ``.metadata`` is a plain pickle; loading it with ``pickle.load`` runs whatever it
names. We unpickle it with :class:`~reshard_svc.format.unpickle.AllowListUnpickler`, which
resolves only the handful of
torch metadata classes, dtypes and path types a DCP save really contains, and raises
:class:`~reshard_svc.errors.UnsafePickleError` naming anything else. Tensor items in the
``.distcp`` files are ``torch.save`` archives, read with ``weights_only=True``.

Operators can refuse DCP pickles entirely with ``RESHARD_ALLOW_DCP_PICKLE=0`` (the server
does so by default).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Collection
from typing import Any

import torch

from reshard_svc.errors import CorruptCheckpointError, UnsafePickleError
from reshard_svc.format.index import Blob, CheckpointIndex, Chunk, FileMeta, TensorMeta
from reshard_svc.format.reader import BaseSource
from reshard_svc.format.unpickle import safe_unpickle
from reshard_svc.layout import Box
from reshard_svc.storage import Storage

__all__ = [
    "DCP_METADATA",
    "SOURCE",
    "DistCP",
    "decode_torch_save",
    "index_from_distcp",
    "index_from_metadata",
]

ENV_ALLOW = "RESHARD_ALLOW_DCP_PICKLE"
DCP_METADATA = ".metadata"
TORCH_SAVE = "torch_save"


def decode_torch_save(raw: bytes | memoryview, where: str) -> torch.Tensor:
    """One DCP tensor item (a ``torch.save`` archive), loaded with weights_only=True."""
    try:
        obj = torch.load(io.BytesIO(bytes(raw)), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: tensor item cannot be loaded: {e}") from e
    if not isinstance(obj, torch.Tensor):
        raise CorruptCheckpointError(f"{where}: item is a {type(obj).__name__}, not a tensor")
    return obj


def index_from_distcp(storage: Storage) -> CheckpointIndex:
    """Describe a DCP ``.distcp`` folder from its ``.metadata`` (allow-listed unpickling)."""
    if os.environ.get(ENV_ALLOW, "1") in ("0", "false", "no"):
        raise UnsafePickleError(
            f"{storage.uri} is a torch DCP .distcp checkpoint, whose metadata is a pickle; "
            f"this process refuses pickles ({ENV_ALLOW}=0). Ask the operator to allow it."
        )
    md = safe_unpickle(storage.read(DCP_METADATA))
    return index_from_metadata(md, storage.size, f"{storage.uri}/{DCP_METADATA}")


def index_from_metadata(md: Any, size_of: Callable[[str], int], where: str) -> CheckpointIndex:
    """The index a DCP ``Metadata`` object describes (``size_of``: a data file's size):
    tensor chunks as ``torch_save`` items of the ``.distcp`` files, byte items as opaque
    blobs."""
    sdm = getattr(md, "state_dict_metadata", None)
    storage_data = getattr(md, "storage_data", None)
    if not isinstance(sdm, dict) or not isinstance(storage_data, dict):
        raise CorruptCheckpointError(f"{where} is not DCP Metadata")
    where_of: dict[tuple[str, tuple[int, ...]], Any] = {}
    bytes_at: dict[str, Any] = {}
    for mi, info in storage_data.items():
        if getattr(mi, "offset", None) is not None:
            where_of[(mi.fqn, tuple(mi.offset))] = info
        else:
            bytes_at[str(mi.fqn)] = info
    tensors: dict[str, TensorMeta] = {}
    blobs: dict[str, Blob] = {}
    files: set[str] = set()
    for fqn, tmd in sdm.items():
        if not hasattr(tmd, "chunks"):
            # BytesStorageMetadata: a torch.save'd object (train state, dataloader state).
            # Carried as opaque bytes, never unpickled.
            info = bytes_at.get(fqn)
            if info is None:
                raise CorruptCheckpointError(f"{fqn!r}: bytes item has no storage entry")
            name = str(info.relative_path)
            files.add(name)
            start = int(info.offset)
            blobs[fqn] = Blob(
                name=fqn,
                file=name,
                begin=start,
                end=start + int(info.length),
                encoding="torch_save",
            )
            continue
        chunks = []
        for c in tmd.chunks:
            info = where_of.get((fqn, tuple(c.offsets)))
            if info is None:
                raise CorruptCheckpointError(
                    f"{fqn!r}: chunk {list(c.offsets)} has no storage entry"
                )
            if getattr(info, "transform_descriptors", None):
                raise CorruptCheckpointError(
                    f"{fqn!r}: stored with transforms {info.transform_descriptors}, unsupported"
                )
            name = str(info.relative_path)
            files.add(name)
            chunks.append(
                Chunk(
                    box=Box(tuple(c.offsets), tuple(c.sizes)),
                    file=name,
                    begin=int(info.offset),
                    end=int(info.offset) + int(info.length),
                    encoding=TORCH_SAVE,
                )
            )
        tensors[fqn] = TensorMeta(
            name=fqn,
            dtype=tmd.properties.dtype,
            shape=tuple(tmd.size),
            layout=None,
            chunks=tuple(sorted(chunks, key=lambda c: c.box)),
        )
    index = CheckpointIndex(
        tensors=tensors,
        files={f: FileMeta(size_of(f)) for f in sorted(files)},
        source="dcp",
        blobs=blobs,
    )
    index.check()
    return index


class DistCP(BaseSource):
    kinds = ("dcp",)
    why_unchecked = "torch DCP .distcp files record no checksums"

    def claims(self, names: Collection[str]) -> bool:
        return DCP_METADATA in names

    def open(self, storage: Storage, names: Collection[str]) -> CheckpointIndex:
        return index_from_distcp(storage)


SOURCE = DistCP()
