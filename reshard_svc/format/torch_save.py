"""Read a ``torch.save`` zip archive without running its pickle.

A ``torch.save`` file is a zip of stored (uncompressed) records: ``data.pkl``, the pickled
object, and ``data/<key>``, the raw bytes of each storage. :class:`Archives` opens them
through ranged reads of any :class:`~reshard_svc.storage.Storage`: the zip directory (by
``zipfile``), each record's data offset (from its local header), and the ``data.pkl``
walked by :class:`~reshard_svc.format.unpickle.InertUnpickler`, which imports and runs
nothing. Only tensor rebuilds get a meaning (a :class:`TensorRef`: record key, storage
offset, shape, stride, dtype); every other global becomes an inert stand-in. Used by the
torch_checkpointing source.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reshard_svc.errors import CorruptCheckpointError
from reshard_svc.format.unpickle import inert_load
from reshard_svc.storage import Storage

__all__ = [
    "SKIP",
    "Archives",
    "plain_values",
    "zip_crc_table",
]

_MAX_DEPTH = 64


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
            self._trees[file] = inert_load(raw, f"{file}: data.pkl")
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
