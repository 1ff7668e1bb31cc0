"""The checkpoint formats we read, one module each, on one protocol
(:class:`reshard_svc.format.reader.Source`), and :func:`open_checkpoint`, which opens a
folder with the first that claims it:

- :mod:`~reshard_svc.format.readers.ours` — ``reshard.index.json`` (block CRC32Cs);
- :mod:`~reshard_svc.format.readers.hf` — HF safetensors folders, torch DCP's HF output;
- :mod:`~reshard_svc.format.readers.torch_checkpointing` — ``metadata.pkl`` + rank zips;
- :mod:`~reshard_svc.format.readers.megatron` — Megatron-Core ``torch_dist``;
- :mod:`~reshard_svc.format.readers.dcp` — torch DCP ``.distcp``.

Folders are described from headers and metadata alone: no tensor data is fetched to open
a checkpoint.
"""

from __future__ import annotations

from typing import Any

from reshard_svc.errors import NotACheckpointError
from reshard_svc.format.index import INDEX_NAME, CheckpointIndex
from reshard_svc.format.reader import Source
from reshard_svc.format.readers import dcp, hf, megatron, ours, torch_checkpointing
from reshard_svc.storage import Storage, open_storage

__all__ = ["SOURCES", "open_checkpoint", "source_of"]

#: In the order they are asked: ours first, Megatron before the DCP it is made of.
SOURCES: tuple[Source, ...] = (
    ours.SOURCE,
    hf.SOURCE,
    torch_checkpointing.SOURCE,
    megatron.SOURCE,
    dcp.SOURCE,
)


def open_checkpoint(
    uri: str | Storage, storage_options: dict[str, Any] | None = None
) -> tuple[Storage, CheckpointIndex]:
    """Open a checkpoint folder and describe it. Raises NotACheckpointError if it is none."""
    storage = uri if not isinstance(uri, str) else open_storage(uri, storage_options)
    names = storage.listdir()
    if len(names) <= 1 and (kind := storage.root_kind()) != "folder":
        if kind == "file":
            raise NotACheckpointError(
                f"{storage.uri} is a file, not a checkpoint folder: pass the folder that holds it"
            )
        raise NotACheckpointError(f"{storage.uri} does not exist: check the path")
    listing = frozenset(names)
    for source in SOURCES:
        if source.claims(listing):
            return storage, source.open(storage, listing)
    for source in SOURCES:
        source.not_mine(storage, listing)
    raise NotACheckpointError(
        f"{storage.uri}: no {INDEX_NAME}, safetensors files or DCP .metadata — not a "
        "checkpoint (or a save that never committed)"
    )


def source_of(index: CheckpointIndex) -> Source:
    """The source an index was opened by (by its ``source`` kind)."""
    for source in SOURCES:
        if index.source in source.kinds:
            return source
    return ours.SOURCE
