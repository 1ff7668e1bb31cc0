"""Open any supported checkpoint folder as a :class:`CheckpointIndex`.

* native reshard_svc checkpoints (``reshard.index.json``);
* torch DCP Hugging Face safetensors folders (``HuggingFaceStorageWriter``): chunk
  offsets from each file's ``DCP_SHARDING_INFO``;
* plain Hugging Face folders (``model*.safetensors``): every tensor whole;
* torch DCP ``.distcp`` folders: ``.metadata`` through the allow-listed unpickler.

Foreign folders are described from their headers alone (ranged reads of each file's
first bytes); no tensor data is fetched to open a checkpoint.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from reshard_svc.errors import (
    CorruptCheckpointError,
    InconsistentIndexError,
    MissingFileError,
    NotACheckpointError,
)
from reshard_svc.format.hf import HF_INDEX
from reshard_svc.format.index import (
    INDEX_NAME,
    Blob,
    CheckpointIndex,
    Chunk,
    FileMeta,
    TensorMeta,
)
from reshard_svc.format.safetensors import ParsedHeader, parse_header
from reshard_svc.layout import Box
from reshard_svc.storage import Storage, open_storage

__all__ = ["SAVE_TOKEN_KEY", "open_checkpoint", "read_header"]

logger = logging.getLogger(__name__)

#: Metadata key our data files carry; a folder of such files without an index is an
#: uncommitted save and must not be mistaken for a foreign checkpoint.
SAVE_TOKEN_KEY = "RESHARD_SAVE"
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
_PROBE = 64 * 1024


def read_header(storage: Storage, name: str, size: int) -> ParsedHeader:
    """Parse one safetensors file's header with at most two ranged reads."""
    want = min(size, _PROBE)
    (prefix,) = storage.read_ranges([(name, 0, want)]) if want else [memoryview(b"")]
    result = parse_header(bytes(prefix), size, name)
    if isinstance(result, int):
        (prefix,) = storage.read_ranges([(name, 0, result)])
        result = parse_header(bytes(prefix), size, name)
    if isinstance(result, int):  # pragma: no cover - parse_header asked for bytes it has
        raise CorruptCheckpointError(f"{name}: could not read its header")
    return result


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
    if INDEX_NAME in names:
        index = CheckpointIndex.loads(storage.read(INDEX_NAME), f"{storage.uri}/{INDEX_NAME}")
        index.check()
        _check_files_present(storage, index)
        return storage, index
    st_files = [n for n in names if n.endswith(".safetensors")]
    if st_files:
        index = _from_safetensors(storage, st_files)
        if HF_INDEX in names:
            _check_hf_index(storage, index)
        return storage, index
    if "metadata.pkl" in names:
        from reshard_svc.format.torch_ckpt import index_from_torch_checkpointing

        return storage, index_from_torch_checkpointing(storage)
    if ".metadata" in names:
        from reshard_svc.format.dcp import index_from_distcp

        if MEGATRON_METADATA in names:
            return storage, _megatron(storage, index_from_distcp(storage))
        return storage, index_from_distcp(storage)
    from reshard_svc.format.torch_ckpt import not_a_torch_checkpointing_save

    not_a_torch_checkpointing_save(storage, names)
    raise NotACheckpointError(
        f"{storage.uri}: no {INDEX_NAME}, safetensors files or DCP .metadata — not a "
        "checkpoint (or a save that never committed)"
    )


MEGATRON_METADATA = "metadata.json"
MEGATRON_COMMON = "common.pt"


def _read_json(storage: Storage, name: str) -> tuple[str, Any]:
    """(where, parsed) of a small JSON file of the folder; unparsable is corrupt."""
    where = f"{storage.uri}/{name}"
    try:
        return where, json.loads(storage.read(name))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON: {e}") from e


def _megatron(storage: Storage, index: CheckpointIndex) -> CheckpointIndex:
    """A Megatron-Core ``dist_checkpointing`` folder: torch DCP underneath (the
    ``torch_dist`` backend), plus ``metadata.json`` and ``common.pt`` (the non-sharded
    state: iteration, args, RNG...), which is carried verbatim as an opaque blob."""
    where, meta = _read_json(storage, MEGATRON_METADATA)
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != "torch_dist":
        raise CorruptCheckpointError(
            f"{where}: sharded_backend is {backend!r}; reshard_svc reads Megatron-Core's "
            "torch_dist checkpoints"
        )
    index.source = "megatron"
    index.extras = {"megatron": {k: v for k, v in meta.items() if isinstance(v, (str, int))}}
    sizes = storage.sizes()
    if MEGATRON_COMMON in sizes:
        size = sizes[MEGATRON_COMMON]
        # its non-sharded values (iteration, optimizer param_groups) sit at the state dict's root
        index.blobs[MEGATRON_COMMON] = Blob(
            name=MEGATRON_COMMON, file=MEGATRON_COMMON, begin=0, end=size, key=""
        )
        index.files[MEGATRON_COMMON] = FileMeta(size)
    return index


def _check_hf_index(storage: Storage, index: CheckpointIndex) -> None:
    """A Hugging Face ``model.safetensors.index.json`` must agree with the files."""
    where, data = _read_json(storage, HF_INDEX)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
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


def _check_files_present(storage: Storage, index: CheckpointIndex) -> None:
    """Every data file the index lists exists with the size it records (one listing)."""
    sizes = storage.sizes()
    for name, meta in sorted(index.files.items()):
        if name not in sizes:
            raise MissingFileError(f"{storage.uri}: data file {name} is missing")
        if sizes[name] != meta.size:
            raise CorruptCheckpointError(
                f"{storage.uri}: {name} is {sizes[name]} bytes but the index records "
                f"{meta.size}: truncated or overwritten"
            )


def _from_safetensors(storage: Storage, files: list[str]) -> CheckpointIndex:
    sizes = {n: storage.size(n) for n in files}
    chunks: dict[str, list[tuple[Chunk, Any]]] = {}
    dcp = False
    for name in files:
        header = read_header(storage, name, sizes[name])
        if SAVE_TOKEN_KEY in header.metadata:
            raise NotACheckpointError(
                f"{storage.uri}: holds data files of a reshard save but no {INDEX_NAME}: "
                "the save never committed"
            )
        sharding: dict[str, Any] = {}
        if DCP_SHARDING_INFO in header.metadata:
            dcp = True
            try:
                sharding = json.loads(header.metadata[DCP_SHARDING_INFO])
            except (ValueError, RecursionError) as e:
                raise CorruptCheckpointError(f"{name}: {DCP_SHARDING_INFO} is not JSON") from e
            if not isinstance(sharding, dict):
                raise CorruptCheckpointError(f"{name}: {DCP_SHARDING_INFO} is not an object")
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
            chunks.setdefault(key, []).append(
                (Chunk(box=box, file=name, begin=entry.begin, end=entry.end), entry)
            )
    tensors: dict[str, TensorMeta] = {}
    for key, items in chunks.items():
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
    index = CheckpointIndex(
        tensors=tensors,
        files={n: FileMeta(sizes[n]) for n in files},
        source="dcp-hf" if dcp else "hf",
    )
    index.check()
    return index
