"""Read ``torch_checkpointing`` folders (torchtitan's next checkpointer) without running
their pickles.

A save by ``torch_checkpointing.CheckpointManager`` is a folder with

* ``metadata.pkl``: a pickle of plain dicts, lists, tuples, strings and ints — each item's
  tensors by nested path, with the ranks holding them and their sharding (a DTensor's
  mesh and placements, or explicit ``default_tensor_v1`` offsets). We unpickle it with an
  unpickler that resolves **no** global at all: a file naming any class or function is
  refused (:class:`~reshard_svc.errors.UnsafePickleError`).
* ``<item>_<rank>.pt``: each rank's part of an item, a ``torch.save`` zip archive whose
  ``data.pkl`` holds that rank's local tensors and whose ``data/<key>`` records hold the
  bytes (stored, not compressed). We never load ``data.pkl`` as Python objects: an inert
  unpickler walks it and only learns, for each tensor, which record, offset, shape and
  stride it uses (:mod:`reshard_svc.format.torch_save`). The tensor bytes are then plain ranged reads
  of the records, like any other chunk.

Items saved without a resharder (``step`` in ``mgr.save(path, {"model": sd, "step": 7})``)
have no metadata; their files are carried as opaque ``torch_save`` blobs, never unpickled.
The format has no checksums of its own beyond the zip's per-record CRC-32, which
:func:`zip_crc_table` exposes for ``verify``.
"""

from __future__ import annotations

import io
import json
import math
import posixpath
import re
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc.errors import CorruptCheckpointError, NotACheckpointError, UnsafePickleError
from reshard_svc.format.checksums import crc32c
from reshard_svc.format.index import Blob, CheckpointIndex, Chunk, FileMeta, TensorMeta
from reshard_svc.format.reader import SPAN, BaseSource, DataCheck
from reshard_svc.format.torch_save import SKIP, Archives, plain_values
from reshard_svc.format.torch_save import zip_crc_table as zip_crc_table
from reshard_svc.format.unpickle import PlainUnpickler, TensorRef, read_ints
from reshard_svc.layout import Box, Layout, Mesh, Replicate, Shard, StridedShard
from reshard_svc.layout.sharding import local_slices
from reshard_svc.storage import Storage

__all__ = [
    "KIND",
    "METADATA_NAME",
    "SOURCE",
    "TorchCheckpointing",
    "index_from_torch_checkpointing",
    "replica_copies",
    "zip_crc_table",
]

METADATA_NAME = "metadata.pkl"
KIND = "torch_checkpointing"
_RANK_FILE = re.compile(r"(.+)_(\d+)\.pt")


# ---------------------------------------------------------------- metadata


def _load_metadata(storage: Storage) -> dict[str, Any]:
    raw = storage.read(METADATA_NAME)
    try:
        md = PlainUnpickler(io.BytesIO(raw), METADATA_NAME).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # a malformed pickle raises many types
        raise CorruptCheckpointError(f"{METADATA_NAME} is not a readable pickle: {e}") from e
    if not isinstance(md, dict) or not isinstance(md.get("metadata"), dict):
        raise CorruptCheckpointError(f"{METADATA_NAME} is not torch_checkpointing metadata")
    version = str(md.get("version", ""))
    if not version.startswith("2."):
        raise CorruptCheckpointError(
            f"{METADATA_NAME} is torch_checkpointing metadata version {version!r}; "
            "reshard_svc reads version 2.x"
        )
    return md


def _field(data: Any, key: str, where: str) -> Any:
    if not isinstance(data, Mapping) or key not in data:
        raise CorruptCheckpointError(f"{METADATA_NAME}: {where} has no {key!r}")
    return data[key]


def _dtype(text: Any, where: str) -> torch.dtype:
    name = text[len("torch.") :] if isinstance(text, str) and text.startswith("torch.") else ""
    dtype = getattr(torch, name, None) if name else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{METADATA_NAME}: {where} has dtype {text!r}")
    return dtype


def _shape(value: Any, where: str) -> tuple[int, ...]:
    got = read_ints(value)
    if got == (-1,):
        raise CorruptCheckpointError(f"{METADATA_NAME}: {where} has shape {value!r}")
    return got


def _placement(p: Any, where: str) -> Any:
    kind = p.get("type") if isinstance(p, Mapping) else None
    if kind == "Replicate":
        return Replicate()
    if kind == "Shard":
        return Shard(int(_field(p, "dim", where)))
    if kind == "StridedShard":
        return StridedShard(int(_field(p, "dim", where)), int(_field(p, "split_factor", where)))
    raise CorruptCheckpointError(
        f"{METADATA_NAME}: {where} has placement {p!r}; supported: Shard, StridedShard, Replicate"
    )


@dataclass(frozen=True)
class _RankPart:
    """One rank's stored part of a tensor: global box, and where it sits in the local tensor."""

    rank: int
    box: Box
    local: tuple[slice, ...] | None  # None: the whole local tensor


def _pieces(group: Mapping[str, Any], where: str) -> tuple[torch.dtype, tuple[int, ...], list]:
    ranks = _field(group, "ranks", where)
    sharding = _field(group, "sharding_metadata", where)
    kind, data = _field(sharding, "type", where), _field(sharding, "data", where)
    if not isinstance(ranks, (list, tuple)) or not all(isinstance(r, int) for r in ranks):
        raise CorruptCheckpointError(f"{METADATA_NAME}: {where} has ranks {ranks!r}")
    dtype = _dtype(_field(data, "dtype", where), where)
    shape = _shape(_field(data, "global_shape", where), where)
    pieces: list[_RankPart] = []
    if kind == "DTensorShardingMetadata":
        spec = _field(data, "mesh_spec", where)
        mesh_shape = _shape(_field(spec, "mesh_shape", where), where)
        mesh_ranks = list(_field(spec, "mesh_data", where))
        placements = [_placement(p, where) for p in _field(data, "placements", where)]
        layout = Layout(Mesh(mesh_shape), tuple(placements))
        if len(mesh_ranks) != layout.mesh.size:
            raise CorruptCheckpointError(f"{METADATA_NAME}: {where}: mesh data/shape disagree")
        shards = layout.shards(shape)
        for rank in ranks:
            if rank not in mesh_ranks:
                raise CorruptCheckpointError(
                    f"{METADATA_NAME}: {where}: rank {rank} is not in its mesh"
                )
            boxes = [b for b in shards[mesh_ranks.index(rank)] if not b.is_empty]
            for box, sl in zip(boxes, local_slices(boxes), strict=True):
                pieces.append(_RankPart(rank, box, sl))
    elif kind == "default_tensor_v1":
        offs, locs, sizes = (
            _field(data, k, where) for k in ("global_offsets", "local_offsets", "local_sizes")
        )
        if not isinstance(offs, (list, tuple)) or not len(offs) == len(locs) == len(sizes):
            raise CorruptCheckpointError(f"{METADATA_NAME}: {where}: malformed shard lists")
        for off, loc, size in zip(offs, locs, sizes, strict=True):
            box = Box(_shape(off, where), _shape(size, where))
            sl = tuple(slice(a, a + n) for a, n in zip(_shape(loc, where), box.sizes, strict=True))
            if not box.is_empty:  # ranks with the same offsets hold replicas (one group)
                pieces.extend(_RankPart(rank, box, sl) for rank in ranks)
    else:
        raise CorruptCheckpointError(
            f"{METADATA_NAME}: {where} has sharding {kind!r}; supported: "
            "DTensorShardingMetadata, default_tensor_v1"
        )
    return dtype, shape, pieces


def _rank_file(item: str, rank: int, layout_info: Any, where: str) -> str:
    if layout_info is None:
        return f"{item}_{rank}.pt"
    path = _field(layout_info, "file_path", where)
    fmt = _field(_field(layout_info, "serialization_format", where), "type", where)
    if fmt != "TorchSerialization":
        raise CorruptCheckpointError(
            f"{where} is stored as {fmt}; reshard_svc reads torch_checkpointing's torch.save "
            "files (TorchSerialization)"
        )
    norm = posixpath.normpath(path) if isinstance(path, str) else ""
    if not norm or norm.startswith(("/", "../")) or norm == ".." or "\\" in norm:
        raise CorruptCheckpointError(
            f"{METADATA_NAME}: {where} names file {path!r}, outside the checkpoint folder"
        )
    return norm


def _lookup(tree: Any, path: Sequence[Any], where: str) -> TensorRef:
    node = tree
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            raise CorruptCheckpointError(f"{where}: not in the rank's data file")
    if not isinstance(node, TensorRef):
        raise CorruptCheckpointError(f"{where}: the rank's data file holds no tensor there")
    return node


def _byte_range(
    ref: TensorRef, sl: tuple[slice, ...] | None, itemsize: int, where: str
) -> tuple[int, int]:
    """Bytes of a local region, relative to its record, if they are one contiguous run."""
    size = ref.size
    expect = tuple(math.prod(size[i + 1 :]) for i in range(len(size)))
    if any(s != e for s, e, n in zip(ref.stride, expect, size, strict=False) if n > 1) or len(
        ref.stride
    ) != len(size):
        raise CorruptCheckpointError(
            f"{where}: the local tensor is not contiguous (stride {list(ref.stride)}); "
            "reshard_svc reads contiguous local tensors"
        )
    region = sl or tuple(slice(0, n) for n in size)
    starts = [s.start for s in region]
    lens = [s.stop - s.start for s in region]
    if any(a < 0 or a + n > m for a, n, m in zip(starts, lens, size, strict=True)):
        raise CorruptCheckpointError(f"{where}: region {region} is outside the local tensor")
    i = 0
    while i < len(lens) and lens[i] == 1:
        i += 1
    if any(lens[j] != size[j] for j in range(i + 1, len(size))):
        raise CorruptCheckpointError(
            f"{where}: its box is not one contiguous run of the rank's local tensor; "
            "reshard_svc cannot read it as a range"
        )
    first = ref.offset + sum(a * e for a, e in zip(starts, expect, strict=True))
    return first * itemsize, (first + math.prod(lens)) * itemsize


def index_from_torch_checkpointing(storage: Storage) -> CheckpointIndex:
    """Describe a torch_checkpointing folder: tensors from its metadata and data-file
    records, items without metadata as opaque blobs."""
    return _index(storage, None)


def replica_copies(storage: Storage) -> _Copies:
    """Every stored copy of each box more than one rank saved, ``(rank, chunk)`` in rank
    order. torch_checkpointing writes each rank's copy of a "replicated" tensor to that
    rank's file (and treats plain tensors as replicated, whatever they hold), so ``verify``
    compares them: a tensor whose copies differ would otherwise come out as the lowest
    rank's, silently."""
    copies: _Copies = {}
    _index(storage, copies)
    return {k: v for k, v in copies.items() if len(v) > 1}


_Copies = dict[tuple[str, Box], list[tuple[int, Chunk]]]


def _index(storage: Storage, copies: _Copies | None) -> CheckpointIndex:
    md = _load_metadata(storage)
    files = Archives(storage)
    tensors: dict[str, TensorMeta] = {}
    covered: set[str] = set()  # the data files of items with metadata
    extras: dict[str, Any] = {}
    for item, item_md in sorted(md["metadata"].items()):
        paths, layout_info = _item(item, item_md)
        for rank, info in layout_info.items():
            covered.add(_rank_file(item, int(rank), info, f"item {item!r} rank {rank}"))
        for path_text, groups in paths.items():
            meta = _tensor(files, item, layout_info, path_text, groups, copies)
            tensors[meta.name] = meta
        if layout_info:  # the item's plain values (an optimizer's param_groups), as rank 0 saved
            first = min(int(r) for r in layout_info)
            plain = plain_values(
                files.tree(_rank_file(item, first, layout_info[first], item), item), 0
            )
            if plain not in (SKIP, {}, []):
                extras[item] = plain
    blobs = _uncovered_rank_files(files.sizes, covered)
    used = {c.file for t in tensors.values() for c in t.chunks} | {b.file for b in blobs.values()}
    index = CheckpointIndex(
        tensors=tensors,
        files={f: FileMeta(files.sizes[f]) for f in sorted(used)},
        extras=extras,
        source=KIND,
        blobs=blobs,
    )
    index.check()
    return index


def _item(item: Any, item_md: Any) -> tuple[Mapping[str, Any], Mapping[Any, Any]]:
    if not isinstance(item, str) or not item:
        raise CorruptCheckpointError(f"{METADATA_NAME}: item name {item!r}")
    paths = _field(item_md, "nested_path_to_metadata", item)
    layout_info = _field(item_md, "rank_to_layout_info", item)
    if not isinstance(paths, Mapping) or not isinstance(layout_info, Mapping):
        raise CorruptCheckpointError(f"{METADATA_NAME}: item {item!r} is malformed")
    return paths, layout_info


def _tensor(
    files: Archives,
    item: str,
    layout_info: Mapping[Any, Any],
    path_text: Any,
    groups: Any,
    copies: _Copies | None,
) -> TensorMeta:
    """One tensor of an item: a chunk per stored box (the lowest rank's copy of a replica;
    every copy into ``copies`` when asked)."""
    try:
        path = json.loads(path_text)
    except (TypeError, ValueError):
        path = None
    if not isinstance(path, list) or not all(isinstance(p, (str, int)) for p in path):
        raise CorruptCheckpointError(f"{METADATA_NAME}: nested path {path_text!r}")
    name = ".".join([item, *map(str, path)])
    chunks: dict[tuple, Chunk] = {}
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    for group in groups if isinstance(groups, list) else [None]:
        g_dtype, g_shape, pieces = _pieces(group or {}, name)
        if (dtype, shape) not in ((None, None), (g_dtype, g_shape)):
            raise CorruptCheckpointError(f"{name}: its rank groups disagree on shape")
        dtype, shape = g_dtype, g_shape
        for piece in sorted(pieces, key=lambda p: p.rank):
            key = (piece.box.offsets, piece.box.sizes)
            if key in chunks and copies is None:
                continue  # a replica: the lowest rank's copy is read
            chunk = _chunk(files, item, layout_info, path, piece, g_dtype, name)
            chunks.setdefault(key, chunk)
            if copies is not None:
                copies.setdefault((name, piece.box), []).append((piece.rank, chunk))
    if dtype is None or shape is None:
        raise CorruptCheckpointError(f"{METADATA_NAME}: {name} has no rank groups")
    return TensorMeta(
        name=name,
        dtype=dtype,
        shape=shape,
        layout=None,
        chunks=tuple(sorted(chunks.values(), key=lambda c: c.box)),
    )


def _chunk(
    files: Archives,
    item: str,
    layout_info: Mapping[Any, Any],
    path: Sequence[Any],
    piece: _RankPart,
    dtype: torch.dtype,
    name: str,
) -> Chunk:
    """Where ``piece`` sits in its rank's data file, as a byte range."""
    where = f"{name} (rank {piece.rank})"
    file = _rank_file(item, piece.rank, layout_info.get(piece.rank), where)
    ref = _lookup(files.tree(file, where), path, where)
    if ref.dtype != dtype:
        raise CorruptCheckpointError(f"{where}: stored as {ref.dtype}, the metadata says {dtype}")
    lo, hi = _byte_range(ref, piece.local, dtype.itemsize, where)
    begin, end = files.record(file, ref.key, where)
    if begin + hi > end:
        raise CorruptCheckpointError(f"{where}: runs past its record")
    return Chunk(box=piece.box, file=file, begin=begin + lo, end=begin + hi)


def _uncovered_rank_files(sizes: Mapping[str, int], covered: set[str]) -> dict[str, Blob]:
    """``<item>_<rank>.pt`` files of items saved without a resharder: opaque blobs."""
    blobs = {}
    for f in sorted(sizes):
        m = _RANK_FILE.fullmatch(f)
        if m and f not in covered:
            name = f"{m.group(1)}/rank{m.group(2)}"
            # each rank's own value of the item: `load` gives a rank its own copy
            blobs[name] = Blob(
                name=name, file=f, begin=0, end=sizes[f], encoding="torch_save", key=m.group(1)
            )
    return blobs


def not_a_torch_checkpointing_save(storage: Storage, names: Sequence[str]) -> None:
    """A folder of ``<item>_<rank>.pt`` files with no metadata.pkl: say what it lacks."""
    if any(_RANK_FILE.fullmatch(n) for n in names):
        raise NotACheckpointError(
            f"{storage.uri} holds torch_checkpointing-style <item>_<rank>.pt files but no "
            f"{METADATA_NAME}: nothing says how its tensors are sharded. Save the items with "
            "a resharder (ItemSpec(resharder=DefaultResharder())) so the metadata is written"
        )


class TorchCheckpointing(BaseSource):
    """Its bytes are checked by the zip's CRC-32 of each record; every rank's copy of a
    replicated box must agree."""

    kinds = (KIND,)

    def claims(self, names: Collection[str]) -> bool:
        return METADATA_NAME in names

    def open(self, storage: Storage, names: Collection[str]) -> CheckpointIndex:
        return index_from_torch_checkpointing(storage)

    def checksum(self, index: CheckpointIndex) -> str:
        return "zip-crc32"

    def data_check(self, name: str, meta: FileMeta) -> DataCheck | None:
        return check_zip_records if name.endswith(".pt") else None

    def verify_more(self, storage: Storage, index: CheckpointIndex) -> list[str]:
        return compare_copies(storage)

    def not_mine(self, storage: Storage, names: Collection[str]) -> None:
        not_a_torch_checkpointing_save(storage, list(names))


def check_zip_records(
    storage: Storage, name: str, size: int, found: list[str], advance: Callable[[int], None]
) -> int:
    """Every record of a ``torch.save`` zip against the CRC-32 its directory records."""
    hashed = 0
    for begin, end, crc in zip_crc_table(storage, [name])[name]:
        got = 0
        for a in range(begin, end, SPAN):
            got = zlib.crc32(storage.read_view(name, a, min(end, a + SPAN)), got)
        if got != crc:
            found.append(f"{name}: bytes [{begin}, {end}) fail their zip CRC-32 (corrupted)")
        hashed += end - begin
    advance(size)
    return hashed


def compare_copies(storage: Storage) -> list[str]:
    """torch_checkpointing keeps every rank's copy of a replicated box: they must agree."""
    found = []
    for (name, box), copies in sorted(replica_copies(storage).items(), key=lambda kv: kv[0][0]):
        by_crc: dict[int, list[int]] = {}
        for rank, c in copies:  # a span at a time: replicated tensors can be large
            crc = 0
            for a in range(c.begin, c.end, SPAN):
                crc = crc32c(storage.read_view(c.file, a, min(c.end, a + SPAN)), crc)
            by_crc.setdefault(crc, []).append(rank)
        if len(by_crc) > 1:
            groups = "; ".join(f"rank(s) {rs} hold CRC32C {c:08x}" for c, rs in by_crc.items())
            found.append(
                f"{name} {list(box.offsets)}+{list(box.sizes)}: the writer saved it as "
                f"replicated, but its copies differ ({groups}); a convert or load keeps "
                f"rank {copies[0][0]}'s. Per-rank state needs per-rank keys or a DTensor"
            )
    return found


SOURCE = TorchCheckpointing()
