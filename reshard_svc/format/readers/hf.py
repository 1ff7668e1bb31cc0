"""Hugging Face safetensors folders, and torch DCP's ``HuggingFaceStorageWriter`` output.

Plain HF folders (``model*.safetensors``, maybe ``model.safetensors.index.json``) hold
every tensor whole; DCP's safetensors files say where each piece sits in its
``DCP_SHARDING_INFO`` metadata (``saved_offsets``). Described from the files' headers
alone (ranged reads of their first bytes); no checksums are recorded, so a verify checks
headers, sizes and coverage only. The parsers (:func:`header_chunks`,
:func:`tensors_from_chunks`, :func:`check_weight_map`) take parsed data, not storage.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from reshard_svc.errors import (
    CorruptCheckpointError,
    InconsistentIndexError,
    MissingFileError,
    NotACheckpointError,
)
from reshard_svc.format.hf import HF_INDEX
from reshard_svc.format.index import INDEX_NAME, CheckpointIndex, Chunk, FileMeta, TensorMeta
from reshard_svc.format.reader import (
    DCP_SHARDING_INFO,
    SAVE_TOKEN_KEY,
    BaseSource,
    read_header,
    read_json,
)
from reshard_svc.format.safetensors import HeaderEntry, ParsedHeader
from reshard_svc.layout import Box
from reshard_svc.storage import Storage

__all__ = ["SOURCE", "HuggingFace", "check_weight_map", "header_chunks", "tensors_from_chunks"]

_WHY = {
    "hf": "Hugging Face safetensors files record no checksums",
    "dcp-hf": "torch DCP's safetensors files record no checksums",
}


class HuggingFace(BaseSource):
    kinds = ("hf", "dcp-hf")

    def claims(self, names: Collection[str]) -> bool:
        return any(n.endswith(".safetensors") for n in names)

    def open(self, storage: Storage, names: Collection[str]) -> CheckpointIndex:
        files = sorted(n for n in names if n.endswith(".safetensors"))
        sizes = {n: storage.size(n) for n in files}
        chunks: list[tuple[Chunk, HeaderEntry]] = []
        dcp = False
        for name in files:
            header = read_header(storage, name, sizes[name])
            if SAVE_TOKEN_KEY in header.metadata:
                raise NotACheckpointError(
                    f"{storage.uri}: holds data files of a reshard save but no {INDEX_NAME}: "
                    "the save never committed"
                )
            dcp = dcp or DCP_SHARDING_INFO in header.metadata
            chunks += header_chunks(name, header)
        index = CheckpointIndex(
            tensors=tensors_from_chunks(chunks),
            files={n: FileMeta(sizes[n]) for n in files},
            source="dcp-hf" if dcp else "hf",
        )
        index.check()
        if HF_INDEX in names:
            where, data = read_json(storage, HF_INDEX)
            check_weight_map(data, index, where)
        return index

    def unchecked(self, index: CheckpointIndex) -> str:
        return _WHY[index.source]


def header_chunks(name: str, header: ParsedHeader) -> list[tuple[Chunk, HeaderEntry]]:
    """Each tensor of one file as a chunk of its global tensor: at the offsets its
    ``DCP_SHARDING_INFO`` gives, else whole (at zero)."""
    sharding: Any = {}
    if DCP_SHARDING_INFO in header.metadata:
        try:
            sharding = json.loads(header.metadata[DCP_SHARDING_INFO])
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{name}: {DCP_SHARDING_INFO} is not JSON") from e
        if not isinstance(sharding, dict):
            raise CorruptCheckpointError(f"{name}: {DCP_SHARDING_INFO} is not an object")
    out = []
    for key, entry in header.entries.items():
        offsets: Any = [0] * len(entry.shape)
        if key in sharding:
            info = sharding[key]
            offsets = info.get("saved_offsets") if isinstance(info, dict) else None
            if (
                not isinstance(offsets, list)
                or len(offsets) != len(entry.shape)
                or not all(isinstance(o, int) and o >= 0 for o in offsets)
            ):
                raise CorruptCheckpointError(
                    f"{name}: {DCP_SHARDING_INFO}[{key!r}].saved_offsets is {offsets!r}, "
                    f"expected {len(entry.shape)} non-negative ints"
                )
        box = Box(tuple(offsets), entry.shape)
        out.append((Chunk(box=box, file=name, begin=entry.begin, end=entry.end), entry))
    return out


def tensors_from_chunks(chunks: Iterable[tuple[Chunk, HeaderEntry]]) -> dict[str, TensorMeta]:
    """Chunks grouped into tensors (by header name); their dtype and number of dims must
    agree, and the global shape is where the furthest chunk ends."""
    by_name: dict[str, list[tuple[Chunk, HeaderEntry]]] = {}
    for chunk, entry in chunks:
        by_name.setdefault(entry.key, []).append((chunk, entry))
    tensors: dict[str, TensorMeta] = {}
    for key, items in by_name.items():
        dtypes = {e.dtype for _, e in items}
        if len(dtypes) != 1:
            raise InconsistentIndexError(
                f"tensor {key!r}: shards disagree on dtype ({', '.join(sorted(map(str, dtypes)))})"
            )
        ndims = {len(e.shape) for _, e in items}
        if len(ndims) != 1:
            raise InconsistentIndexError(f"tensor {key!r}: shards disagree on the number of dims")
        boxes = [c.box for c, _ in items]
        shape = tuple(max(b.offsets[d] + b.sizes[d] for b in boxes) for d in range(ndims.pop()))
        tensors[key] = TensorMeta(
            name=key,
            dtype=dtypes.pop(),
            shape=shape,
            layout=None,
            chunks=tuple(sorted((c for c, _ in items), key=lambda c: c.box)),
        )
    return tensors


def check_weight_map(data: Any, index: CheckpointIndex, where: str) -> None:
    """A ``model.safetensors.index.json`` must agree with the files: each name it maps to a
    file that exists and holds it."""
    weight_map = data.get("weight_map") if isinstance(data, Mapping) else None
    if not isinstance(weight_map, Mapping):
        raise CorruptCheckpointError(f"{where} has no weight_map object")
    for name, fname in weight_map.items():
        if not isinstance(fname, str):
            raise CorruptCheckpointError(f"{where}: weight_map[{name!r}] is not a file name")
        if fname not in index.files:
            raise MissingFileError(f"{where} maps {name!r} to {fname}, which is missing")
        meta = index.tensors.get(name)
        if meta is None or all(c.file != fname for c in meta.chunks):
            raise InconsistentIndexError(
                f"{where} maps {name!r} to {fname}, which does not hold it"
            )


SOURCE = HuggingFace()
