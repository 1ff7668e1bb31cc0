"""The storage protocol: a checkpoint folder addressed by a URI, files by relative name.

Reads are ranged; writes stream. Backends translate their failures into
:class:`~reshard_svc.errors.StorageError` (``MissingFileError`` for absent files) with the
original exception as ``__cause__``.

Commit protocol (called by the coordinator only, after every rank has written):

* ``staging(token)`` — the :class:`Storage` every rank writes data files into;
* ``commit(staging, index_bytes)`` — make the checkpoint visible in one step: the index
  is written last, so a crash before it leaves nothing a reader accepts;
* ``abort(staging)`` — drop what a failed save wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, Any, Protocol, runtime_checkable

from reshard_svc.checksums import DEFAULT_BLOCK_SIZE, FileChecksummer

__all__ = ["HashingWriter", "Storage"]


@runtime_checkable
class Storage(Protocol):
    """A folder of files on some storage, addressed by ``uri``."""

    uri: str
    #: File names inside a staging area carry this suffix before ``.safetensors`` so a
    #: save into an object store never overwrites the files of the committed checkpoint.
    file_suffix: str

    def exists(self, name: str) -> bool: ...

    def size(self, name: str) -> int: ...

    def listdir(self) -> list[str]: ...

    def sizes(self) -> dict[str, int]:
        """File name -> size of every file in the folder (one listing)."""
        ...

    def read(self, name: str) -> bytes: ...

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[memoryview]:
        """Bytes ``[start, end)`` of each named file, fetched concurrently where possible."""
        ...

    def read_view(self, name: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of one file, without a copy where the backend can
        (a read-only memory map of a local file); a short file raises CorruptCheckpointError."""
        ...

    def read_into(self, name: str, start: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``start`` (exactly ``len(out)`` bytes)."""
        ...

    def open_write(self, name: str) -> IO[bytes]: ...

    def write(self, name: str, data: bytes) -> None: ...

    def remove(self, name: str) -> None: ...

    def check_target(self, index_name: str) -> None:
        """Raise if saving here could destroy something that is not a checkpoint."""
        ...

    def staging(self, token: str) -> Storage: ...

    def commit(self, staging: Storage, index_name: str, index_bytes: bytes) -> None: ...

    def abort(self, staging: Storage) -> None: ...


class HashingWriter:
    """Wraps a binary stream written front to back; counts bytes and checksums them
    (block CRC32C, plus sha256 when ``algorithm="sha256"``; nothing for ``"none"``)."""

    def __init__(
        self, raw: IO[bytes], algorithm: str = "crc32c", block_size: int = DEFAULT_BLOCK_SIZE
    ) -> None:
        self.raw = raw
        self.sums = FileChecksummer(algorithm, block_size)
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self.sums.update(data)
        self.raw.write(data)
        n = len(data) if isinstance(data, bytes) else data.nbytes
        self.size += n
        return n

    def result(self) -> dict[str, Any]:
        """The index fields of this file's checksums."""
        return self.sums.result()
