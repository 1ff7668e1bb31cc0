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
  stride it uses (:class:`_InertUnpickler`). The tensor bytes are then plain ranged reads
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
import pickle
import posixpath
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc.errors import CorruptCheckpointError, NotACheckpointError, UnsafePickleError
from reshard_svc.format.index import Blob, CheckpointIndex, Chunk, FileMeta, TensorMeta
from reshard_svc.layout import Box, Layout, Mesh, Replicate, Shard, StridedShard
from reshard_svc.layout.sharding import local_slices
from reshard_svc.storage import Storage

__all__ = [
    "METADATA_NAME",
    "SOURCE",
    "index_from_torch_checkpointing",
    "replica_copies",
    "zip_crc_table",
]

METADATA_NAME = "metadata.pkl"
SOURCE = "torch_checkpointing"
_RANK_FILE = re.compile(r"(.+)_(\d+)\.pt")
_MAX_DEPTH = 64


class _PlainUnpickler(pickle.Unpickler):
    """metadata.pkl holds only builtins: any global is refused, whatever it names."""

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(
            f"{METADATA_NAME} names {module}.{name}; torch_checkpointing metadata holds only "
            "plain data, so this file is refused unread"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{METADATA_NAME} refers to persistent objects; refused")


# ---------------------------------------------------------------- data.pkl, read inertly


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """Where a local tensor's bytes are: record ``data/<key>``, element offset, shape, stride."""

    key: str
    dtype: torch.dtype | None
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Inert:
    """Whatever a pickle builds that we do not model: accepts anything, means nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()


class _InertType(type):
    """A stand-in for a named class: constructing or calling it yields an inert object."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _Inert()


_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}  # fmt: skip


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype | None


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> Any:
    if not isinstance(storage, _StorageRef):
        return _Inert()
    return TensorRef(storage.key, storage.dtype, int(offset), _ints(size), _ints(stride))


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """A tensor subclass (DTensor): what we need is its ``_local_tensor``."""
    # state is the instance dict, or (dict, slots) as copyreg builds it
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, dict) and isinstance(part.get("_local_tensor"), TensorRef):
            return part["_local_tensor"]
    return func(*args) if callable(func) else _Inert()


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        return (-1,)  # refused where used: a shape or stride must be non-negative ints
    return tuple(value)


class _Dict(dict):  # type: ignore[type-arg]
    """An OrderedDict; a state dict's carries a ``_metadata`` attribute, ignored."""

    def __setstate__(self, state: Any) -> None:
        pass


_MEANINGFUL: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Size"): tuple,
    ("collections", "OrderedDict"): _Dict,
}


class _InertUnpickler(pickle.Unpickler):
    """Walks a ``torch.save`` ``data.pkl`` without importing or running anything it names.

    Only tensor rebuilds get a meaning (a :class:`TensorRef`); every other global becomes
    an inert stand-in, so the result is the pickled container structure with TensorRefs at
    the tensor leaves and inert objects elsewhere."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _MEANINGFUL:
            return _MEANINGFUL[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return _InertType(name, (_Inert,), {})

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            return _Inert()
        _, stype, key, _location, numel = pid
        dtype = stype.dtype if isinstance(stype, _StorageType) else None
        if not isinstance(key, str) or not isinstance(numel, int):
            return _Inert()
        return _StorageRef(key, dtype, numel)


# ---------------------------------------------------------------- zip records


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of one stored file through ranged reads (for zipfile)."""

    def __init__(self, storage: Storage, name: str, size: int) -> None:
        self.storage, self.name_, self.size, self.pos = storage, name, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf: Any) -> int:
        end = min(self.size, self.pos + len(buf))
        if end <= self.pos:
            return 0
        data = self.storage.read_ranges([(self.name_, self.pos, end)])[0]
        n = len(data)
        buf[:n] = data
        self.pos += n
        return n


@dataclass(frozen=True)
class _Archive:
    """One ``torch.save`` zip: its records' data offsets, sizes and CRC-32s, by short name."""

    file: str
    prefix: str
    records: dict[str, tuple[int, int, int]]  # name -> (begin, end, crc32)

    def record(self, name: str) -> tuple[int, int]:
        got = self.records.get(self.prefix + name)
        if got is None:
            raise CorruptCheckpointError(f"{self.file}: record {name!r} is missing")
        return got[0], got[1]


def _open_archive(storage: Storage, name: str, size: int) -> _Archive:
    try:
        with zipfile.ZipFile(io.BufferedReader(_RangeFile(storage, name, size), 1 << 16)) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CorruptCheckpointError(f"{name} is not a torch.save archive: {e}") from e
    pkl = [i.filename for i in infos if i.filename.endswith("/data.pkl")]
    if len(pkl) != 1 or any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise CorruptCheckpointError(
            f"{name} is not a torch.save archive (one stored data.pkl, no compression)"
        )
    prefix = pkl[0][: -len("data.pkl")]
    # A record's data starts after its local header (30 bytes + name + extra field), whose
    # extra length torch.save uses for alignment padding: read every local header at once.
    heads = storage.read_ranges(
        [(name, i.header_offset, min(size, i.header_offset + 30)) for i in infos]
    )
    records: dict[str, tuple[int, int, int]] = {}
    for info, head in zip(infos, heads, strict=True):
        if len(head) < 30 or bytes(head[:4]) != b"PK\x03\x04":
            raise CorruptCheckpointError(f"{name}: record {info.filename!r} has no local header")
        begin = info.header_offset + 30 + int.from_bytes(head[26:28], "little")
        begin += int.from_bytes(head[28:30], "little")
        end = begin + info.file_size
        if end > size:
            raise CorruptCheckpointError(f"{name}: record {info.filename!r} runs past the end")
        records[info.filename] = (begin, end, info.CRC)
    return _Archive(name, prefix, records)


def _read_record(storage: Storage, archive: _Archive, short: str) -> bytes:
    begin, end = archive.record(short)
    return bytes(storage.read_ranges([(archive.file, begin, end)])[0])


def zip_crc_table(storage: Storage, files: Sequence[str]) -> dict[str, list[tuple[int, int, int]]]:
    """Each archive's records as ``(begin, end, crc32)``: what ``verify`` can check."""
    sizes = storage.sizes()
    return {
        f: sorted(_open_archive(storage, f, sizes[f]).records.values()) for f in files if f in sizes
    }


# ---------------------------------------------------------------- metadata


def _load_metadata(storage: Storage) -> dict[str, Any]:
    raw = storage.read(METADATA_NAME)
    try:
        md = _PlainUnpickler(io.BytesIO(raw)).load()
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
    got = _ints(value)
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
class _Piece:
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
    pieces: list[_Piece] = []
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
                pieces.append(_Piece(rank, box, sl))
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
                pieces.extend(_Piece(rank, box, sl) for rank in ranks)
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


_SKIP = object()


def _plain(node: Any, depth: int) -> Any:
    """The JSON-able part of a data.pkl tree: containers and scalars, tensors left out."""
    if depth > _MAX_DEPTH:
        raise CorruptCheckpointError(f"data.pkl nests deeper than {_MAX_DEPTH} levels")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, dict):
        out = {str(k): _plain(v, depth + 1) for k, v in node.items()}
        kept = {k: v for k, v in out.items() if v is not _SKIP}
        return kept if kept or not node else _SKIP  # only tensors under it: nothing
    if isinstance(node, (list, tuple)):
        items = [_plain(v, depth + 1) for v in node]
        kept_items = [v for v in items if v is not _SKIP]
        return kept_items if kept_items or not node else _SKIP
    return _SKIP


def index_from_torch_checkpointing(storage: Storage) -> CheckpointIndex:
    """Describe a torch_checkpointing folder: tensors from its metadata and data-file
    records, items without metadata as opaque blobs."""
    return _index(storage, None)


def replica_copies(storage: Storage) -> dict[tuple[str, Box], list[tuple[int, Chunk]]]:
    """Every stored copy of each box more than one rank saved, ``(rank, chunk)`` in rank
    order. torch_checkpointing writes each rank's copy of a "replicated" tensor to that
    rank's file (and treats plain tensors as replicated, whatever they hold), so ``verify``
    compares them: a tensor whose copies differ would otherwise come out as the lowest
    rank's, silently."""
    copies: dict[tuple[str, Box], list[tuple[int, Chunk]]] = {}
    _index(storage, copies)
    return {k: v for k, v in copies.items() if len(v) > 1}


def _index(
    storage: Storage, copies: dict[tuple[str, Box], list[tuple[int, Chunk]]] | None
) -> CheckpointIndex:
    md = _load_metadata(storage)
    sizes = storage.sizes()
    archives: dict[str, _Archive] = {}
    trees: dict[str, Any] = {}

    def archive(file: str, where: str) -> _Archive:
        if file not in archives:
            if file not in sizes:
                raise CorruptCheckpointError(f"{where}: data file {file} is missing")
            archives[file] = _open_archive(storage, file, sizes[file])
        return archives[file]

    def tree(file: str, where: str) -> Any:
        if file not in trees:
            a = archive(file, where)
            order = (
                _read_record(storage, a, "byteorder")
                if a.prefix + "byteorder" in a.records
                else b"little"
            )
            if order.strip() != b"little":
                raise CorruptCheckpointError(f"{file} is {order!r}-endian; only little is read")
            raw = _read_record(storage, a, "data.pkl")
            try:
                trees[file] = _InertUnpickler(io.BytesIO(raw)).load()
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
                    KeyError, AttributeError, RecursionError, MemoryError) as e:  # fmt: skip
                raise CorruptCheckpointError(f"{file}: data.pkl is unreadable: {e}") from e
        return trees[file]

    tensors: dict[str, TensorMeta] = {}
    covered: set[str] = set()
    for item, item_md in sorted(md["metadata"].items()):
        if not isinstance(item, str) or not item:
            raise CorruptCheckpointError(f"{METADATA_NAME}: item name {item!r}")
        paths = _field(item_md, "nested_path_to_metadata", item)
        layout_info = _field(item_md, "rank_to_layout_info", item)
        if not isinstance(paths, Mapping) or not isinstance(layout_info, Mapping):
            raise CorruptCheckpointError(f"{METADATA_NAME}: item {item!r} is malformed")
        for rank, info in layout_info.items():
            covered.add(_rank_file(item, int(rank), info, f"item {item!r} rank {rank}"))
        for path_text, groups in paths.items():
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
                    where = f"{name} (rank {piece.rank})"
                    file = _rank_file(item, piece.rank, layout_info.get(piece.rank), where)
                    ref = _lookup(tree(file, where), path, where)
                    if ref.dtype != g_dtype:
                        raise CorruptCheckpointError(
                            f"{where}: stored as {ref.dtype}, the metadata says {g_dtype}"
                        )
                    lo, hi = _byte_range(ref, piece.local, g_dtype.itemsize, where)
                    begin, end = archive(file, where).record(f"data/{ref.key}")
                    if begin + hi > end:
                        raise CorruptCheckpointError(f"{where}: runs past its record")
                    chunk = Chunk(piece.box, file, begin + lo, begin + hi)
                    chunks.setdefault(key, chunk)
                    if copies is not None:
                        copies.setdefault((name, piece.box), []).append((piece.rank, chunk))
            if dtype is None or shape is None:
                raise CorruptCheckpointError(f"{METADATA_NAME}: {name} has no rank groups")
            tensors[name] = TensorMeta(
                name, dtype, shape, None, tuple(sorted(chunks.values(), key=lambda c: c.box))
            )
    extras: dict[str, Any] = {}
    for item, item_md in sorted(md["metadata"].items()):
        ranks = sorted(int(r) for r in item_md["rank_to_layout_info"])
        if ranks:  # the item's plain values (an optimizer's param_groups), as rank 0 saved
            first = _rank_file(item, ranks[0], item_md["rank_to_layout_info"][ranks[0]], item)
            plain = _plain(tree(first, item), 0)
            if plain not in (_SKIP, {}, []):
                extras[item] = plain
    blobs = {}
    for f in sorted(sizes):
        m = _RANK_FILE.fullmatch(f)
        if m and f not in covered:
            name = f"{m.group(1)}/rank{m.group(2)}"
            blobs[name] = Blob(name, f, 0, sizes[f], "torch_save")
    files = {c.file for t in tensors.values() for c in t.chunks} | {b.file for b in blobs.values()}
    index = CheckpointIndex(
        tensors, {f: FileMeta(sizes[f]) for f in sorted(files)}, extras=extras, source=SOURCE,
        blobs=blobs,
    )  # fmt: skip
    index.check()
    return index


def not_a_torch_checkpointing_save(storage: Storage, names: Sequence[str]) -> None:
    """A folder of ``<item>_<rank>.pt`` files with no metadata.pkl: say what it lacks."""
    if any(_RANK_FILE.fullmatch(n) for n in names):
        raise NotACheckpointError(
            f"{storage.uri} holds torch_checkpointing-style <item>_<rank>.pt files but no "
            f"{METADATA_NAME}: nothing says how its tensors are sharded. Save the items with "
            "a resharder (ItemSpec(resharder=DefaultResharder())) so the metadata is written"
        )
