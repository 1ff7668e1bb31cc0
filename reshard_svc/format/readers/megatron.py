"""Megatron-Core ``dist_checkpointing`` folders (Megatron-LM, NeMo, Megatron-Bridge): torch
DCP underneath (the ``torch_dist`` backend), plus ``metadata.json`` and ``common.pt`` (the
non-sharded state: iteration, args, RNG, optimizer ``param_groups``), which is carried
verbatim as an opaque blob (its plain values read by :mod:`reshard_svc.format.values`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from reshard_svc.errors import CorruptCheckpointError
from reshard_svc.format.index import Blob, CheckpointIndex, FileMeta
from reshard_svc.format.reader import BaseSource, read_json
from reshard_svc.format.readers.dcp import DCP_METADATA, index_from_distcp
from reshard_svc.storage import Storage

__all__ = ["MEGATRON_COMMON", "MEGATRON_METADATA", "SOURCE", "Megatron", "megatron_extras"]

MEGATRON_METADATA = "metadata.json"
MEGATRON_COMMON = "common.pt"


class Megatron(BaseSource):
    kinds = ("megatron",)
    why_unchecked = "Megatron-Core's torch_dist files (torch DCP) record no checksums"

    def claims(self, names: Collection[str]) -> bool:
        return DCP_METADATA in names and MEGATRON_METADATA in names

    def open(self, storage: Storage, names: Collection[str]) -> CheckpointIndex:
        index = index_from_distcp(storage)
        where, meta = read_json(storage, MEGATRON_METADATA)
        index.source = "megatron"
        index.extras = {"megatron": megatron_extras(meta, where)}
        sizes = storage.sizes()
        if MEGATRON_COMMON in sizes:
            size = sizes[MEGATRON_COMMON]
            # its non-sharded values (iteration, optimizer param_groups) sit at the state
            # dict's root
            index.blobs[MEGATRON_COMMON] = Blob(
                name=MEGATRON_COMMON, file=MEGATRON_COMMON, begin=0, end=size, key=""
            )
            index.files[MEGATRON_COMMON] = FileMeta(size)
        return index


def megatron_extras(meta: Any, where: str) -> dict[str, Any]:
    """``metadata.json``'s text and int entries, once it says the ``torch_dist`` backend."""
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != "torch_dist":
        raise CorruptCheckpointError(
            f"{where}: sharded_backend is {backend!r}; reshard_svc reads Megatron-Core's "
            "torch_dist checkpoints"
        )
    return {k: v for k, v in meta.items() if isinstance(v, (str, int))}


SOURCE = Megatron()
