"""The storage protocol: a checkpoint folder addressed by a URI, files by relative name.

Reads are ranged; writes stream. Backends translate their failures into
:class:`~reshard_svc.errors.StorageError` (``MissingFileError`` for absent files) with the
original exception as ``__cause__``.

Commit protocol (called by the coordinator only, after every rank has written):

* ``check_target(index_name, overwrite)`` — refuse to replace a committed checkpoint
  without ``overwrite`` (and, locally, to write into a folder that is not a checkpoint);
* ``staging(token)`` — the :class:`Storage` every rank writes data files into;
* ``commit(staging, index_name, index_bytes, replaced)`` — make the checkpoint visible in
  one step: the index is written last, so a crash before it leaves nothing a reader
  accepts. Of the replaced checkpoint only its own files (``replaced``) go; any other file
  in the folder stays;
* ``abort(staging)`` — drop what a failed save wrote.

Leases (see :mod:`reshard_svc.format.collect`): every run keeps a small JSON record beside the target
(``write_lease`` / ``remove_lease`` / ``read_leases``) renewed by a heartbeat, so a later
run or ``reshard gc`` can tell a dead run's leftovers (``collect_run``) from a live one's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from typing import IO, Any, Protocol, runtime_checkable

__all__ = ["COMMIT_FILE", "Storage"]

#: The file whose presence commits a checkpoint folder (written last; the format layer
#: calls it ``INDEX_NAME``). Storage only needs its name, never its contents.
COMMIT_FILE = "reshard.index.json"


@runtime_checkable
class Storage(Protocol):
    """A folder of files on some storage, addressed by ``uri``."""

    uri: str
    #: fsspec options the storage was opened with (endpoint, credentials, retries)
    storage_options: dict[str, Any]
    #: File names inside a staging area carry this suffix before ``.safetensors`` so a
    #: save into an object store never overwrites the files of the committed checkpoint.
    file_suffix: str
    #: Capabilities the runtime plans with. ``local_files``: files live on a local
    #: filesystem (read-only memory maps of the page cache, reads straight into place,
    #: commit by rename); otherwise reads are ranged requests and the index is the commit.
    local_files: bool
    #: The cost model's inputs for reads from this storage: seconds per request, bytes/s.
    latency_s: float
    bandwidth: float

    def exists(self, name: str) -> bool: ...

    def size(self, name: str) -> int: ...

    def listdir(self) -> list[str]: ...

    def root_kind(self) -> str:
        """``folder``, ``file`` or ``missing``: what the URI itself names."""
        ...

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

    def read_runs(self, name: str, start: int, runs: Sequence[memoryview]) -> None:
        """Fill writable byte buffers ``runs``, in order, from consecutive bytes at ``start``
        (locally one ``preadv``: the bytes land in place)."""
        ...

    def positional(
        self, name: str
    ) -> AbstractContextManager[Callable[[int, Sequence[memoryview]], None]]:
        """The file held open for many reads: ``readv(start, runs)`` as :meth:`read_runs`."""
        ...

    def open_write(self, name: str) -> IO[bytes]: ...

    def write(self, name: str, data: bytes) -> None: ...

    def remove(self, name: str) -> None: ...

    def check_target(self, index_name: str, overwrite: bool = False) -> None:
        """Raise TargetExistsError for a committed checkpoint unless ``overwrite``, and
        refuse a target where saving could destroy something that is not a checkpoint."""
        ...

    def staging(self, token: str) -> Storage: ...

    def commit(
        self,
        staging: Any,
        index_name: str,
        index_bytes: bytes,
        replaced: Collection[str] = (),
    ) -> None:
        """Publish ``staging`` with its index; of the old checkpoint, only the files in
        ``replaced`` (its index and data files) may be removed."""
        ...

    def abort(self, staging: Any) -> None: ...

    def pending(self, token: str) -> bool:
        """Whether run ``token`` left something ``collect_run`` must still finish."""
        ...

    # ---- leases and garbage collection (reshard_svc.format.collect)

    def lease_path(self, token: str) -> str: ...

    def write_lease(self, token: str, data: bytes) -> None: ...

    def remove_lease(self, token: str) -> None: ...

    def read_leases(self) -> dict[str, bytes]:
        """Token -> lease record of every run that holds a lease on this target."""
        ...

    def orphan_tokens(self) -> list[str]:
        """Runs whose leftovers are known to be reshard's without a lease (by name)."""
        ...

    def collect_run(
        self, token: str, replaced: set[str] | None, current: set[str], report: Any,
        dry_run: bool,
    ) -> None:  # fmt: skip
        """Clean up after dead run ``token``: finish or roll back its commit, drop its
        uncommitted data; record each step in ``report``."""
        ...
