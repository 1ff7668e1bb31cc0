"""Read a ``torch.save`` zip archive without running its pickle.

A ``torch.save`` file is a zip of stored (uncompressed) records: ``data.pkl``, the pickled
object, and ``data/<key>``, the raw bytes of each storage. :class:`Archives` opens them
through ranged reads of any :class:`~reshard_svc.storage.Storage`: the zip directory (by
``zipfile``), each record's data offset (from its local header), and the ``data.pkl``
walked by :class:`_InertUnpickler`, which imports and runs nothing. Only tensor rebuilds
get a meaning (a :class:`TensorRef`: record key, storage offset, shape, stride, dtype);
every other global becomes an inert stand-in. Used by the torch_checkpointing source.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc.errors import CorruptCheckpointError
from reshard_svc.storage import Storage

__all__ = [
    "SKIP",
    "Archives",
    "TensorRef",
    "inert_load",
    "plain_values",
    "read_ints",
    "zip_crc_table",
]

_MAX_DEPTH = 64


# ---------------------------------------------------------------- data.pkl, read inertly


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None
    numel: int


@dataclass(frozen=True, kw_only=True)
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
    """A stand-in for a named class: constructing or calling it yields an inert object of
    the stand-in's type (so its name can be reported)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__()


_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype | None


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> Any:
    if not isinstance(storage, _StorageRef):
        return _Inert()
    return TensorRef(
        key=storage.key,
        dtype=storage.dtype,
        offset=int(offset),
        size=read_ints(size),
        stride=read_ints(stride),
    )


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """A tensor subclass (DTensor): what we need is its ``_local_tensor``."""
    # state is the instance dict, or (dict, slots) as copyreg builds it
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, dict) and isinstance(part.get("_local_tensor"), TensorRef):
            return part["_local_tensor"]
    return func(*args) if callable(func) else _Inert()


def read_ints(value: Any) -> tuple[int, ...]:
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
        return _InertType(f"{module}.{name}", (_Inert,), {})

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            return _Inert()
        _, stype, key, _location, numel = pid
        dtype = stype.dtype if isinstance(stype, _StorageType) else None
        if not isinstance(key, str) or not isinstance(numel, int):
            return _Inert()
        return _StorageRef(key, dtype, numel)


def inert_load(data: bytes) -> Any:
    """A ``data.pkl`` walked by :class:`_InertUnpickler` (nothing imported or run)."""
    return _InertUnpickler(io.BytesIO(data)).load()


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


class Archives:
    """The ``torch.save`` files of one folder, each opened and walked at most once."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.sizes = storage.sizes()
        self._archives: dict[str, _Archive] = {}
        self._trees: dict[str, Any] = {}

    def archive(self, file: str, where: str) -> _Archive:
        if file not in self._archives:
            if file not in self.sizes:
                raise CorruptCheckpointError(f"{where}: data file {file} is missing")
            self._archives[file] = _open_archive(self.storage, file, self.sizes[file])
        return self._archives[file]

    def tree(self, file: str, where: str) -> Any:
        """The archive's ``data.pkl``, walked inertly (TensorRefs at the tensor leaves)."""
        if file not in self._trees:
            a = self.archive(file, where)
            has_order = a.prefix + "byteorder" in a.records
            order = _read_record(self.storage, a, "byteorder") if has_order else b"little"
            if order.strip() != b"little":
                raise CorruptCheckpointError(f"{file} is {order!r}-endian; only little is read")
            raw = _read_record(self.storage, a, "data.pkl")
            try:
                self._trees[file] = inert_load(raw)
            except (
                pickle.UnpicklingError,
                EOFError,
                ValueError,
                TypeError,
                IndexError,
                KeyError,
                AttributeError,
                RecursionError,
                MemoryError,
            ) as e:
                raise CorruptCheckpointError(f"{file}: data.pkl is unreadable: {e}") from e
        return self._trees[file]

    def record(self, file: str, key: str, where: str) -> tuple[int, int]:
        """``[begin, end)`` of storage record ``data/<key>`` in ``file``."""
        return self.archive(file, where).record(f"data/{key}")


SKIP = object()


def plain_values(node: Any, depth: int) -> Any:
    """The JSON-able part of a data.pkl tree: containers and scalars, tensors left out."""
    if depth > _MAX_DEPTH:
        raise CorruptCheckpointError(f"data.pkl nests deeper than {_MAX_DEPTH} levels")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, dict):
        out = {str(k): plain_values(v, depth + 1) for k, v in node.items()}
        kept = {k: v for k, v in out.items() if v is not SKIP}
        return kept if kept or not node else SKIP  # only tensors under it: nothing
    if isinstance(node, (list, tuple)):
        items = [plain_values(v, depth + 1) for v in node]
        kept_items = [v for v in items if v is not SKIP]
        return kept_items if kept_items or not node else SKIP
    return SKIP
