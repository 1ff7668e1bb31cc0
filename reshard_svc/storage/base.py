"""Three small protocols over a checkpoint folder addressed by a URI, each for its callers.

* :class:`Storage` — bytes: files by relative name, ranged reads, streamed writes. Every
  rank uses it.
* :class:`Committer` — publishing a folder atomically (called by the coordinator only,
  while it holds the target's lease):

  - ``check_target(overwrite)`` refuses to replace a committed checkpoint without
    ``overwrite`` (and, locally, to write into a folder that is not a checkpoint);
  - ``staging(token)`` is the :class:`Storage` every rank writes data files into;
  - ``commit(staging, index_bytes, replaced)`` makes the checkpoint visible in one step:
    the index (:data:`COMMIT_FILE`) is written last, so a crash before it leaves nothing a
    reader accepts. Of the replaced checkpoint only its own files (``replaced``) go;
  - ``abort(staging)`` drops what a failed run wrote;
  - ``runs()`` and ``collect_run(...)`` find and clean up what dead runs left.

* :class:`LeaseStore` — one owner per target: a small record beside the target, created
  atomically (an exclusive create locally, ``If-None-Match: *`` on S3), renewed and
  replaced only by compare-and-swap on its ``version``, so two runs can never both
  believe they hold it (:mod:`reshard_svc.storage.leases`).

Backends implement all three; callers are typed against the one they use. Backends
translate their failures into :class:`~reshard_svc.errors.StorageError`
(``MissingFileError`` for absent files) with the original exception as ``__cause__``.
Nothing here knows what the files mean.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import IO, Protocol, runtime_checkable

__all__ = [
    "COMMIT_FILE",
    "CollectReport",
    "Committer",
    "LeaseHeld",
    "LeaseLost",
    "LeaseState",
    "LeaseStore",
    "Storage",
    "Target",
]

#: The file whose presence commits a checkpoint folder (written last; the format layer
#: calls it ``INDEX_NAME``). Storage only needs its name, never its contents.
COMMIT_FILE = "reshard.index.json"


@runtime_checkable
class Storage(Protocol):
    """A folder of files on some storage, addressed by ``uri``."""

    uri: str
    #: the folder as its backend names it (a path, ``bucket/key``): two storages of one
    #: kind with the same root are the same folder
    root: str
    #: fsspec options the storage was opened with (endpoint, credentials, retries)
    storage_options: dict[str, object]
    #: File names inside a staging area carry this suffix before ``.safetensors`` so a
    #: save into an object store never overwrites the files of the committed checkpoint.
    file_suffix: str
    #: ``local_files``: files live on a local filesystem (read-only memory maps of the
    #: page cache, reads straight into place, commit by rename); otherwise reads are
    #: ranged requests and the index is the commit. ``latency_s`` and ``bandwidth`` are
    #: the cost model's inputs for reads from this storage.
    local_files: bool
    latency_s: float
    bandwidth: float
    #: :meth:`positional_writer` works: files can be written at any offset, from several
    #: threads at once (local files); otherwise a file is written front to back.
    positional_writes: bool

    def exists(self, name: str) -> bool: ...

    def size(self, name: str) -> int: ...

    def modified(self, name: str) -> float | None:
        """When the file was last written (seconds since the epoch), or None when the
        store does not say."""
        ...

    def sizes(self) -> dict[str, int]:
        """File name -> size of every file in the folder (one listing)."""
        ...

    def listdir(self) -> list[str]: ...

    def root_kind(self) -> str:
        """``folder``, ``file`` or ``missing``: what the URI itself names."""
        ...

    def read(self, name: str) -> bytes: ...

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[memoryview]:
        """Bytes ``[start, end)`` of each named file, fetched concurrently where possible."""
        ...

    def read_view(self, name: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of one file, without a copy where the backend can
        (a read-only memory map of a local file); a short file raises CorruptCheckpointError."""
        ...

    def positional(
        self, name: str
    ) -> AbstractContextManager[Callable[[int, Sequence[memoryview]], None]]:
        """The file held open for many reads: ``readv(start, runs)`` fills writable
        buffers ``runs``, in order, from consecutive bytes at ``start`` (locally one
        ``preadv``: the bytes land in place)."""
        ...

    def open_write(self, name: str) -> IO[bytes]: ...

    def positional_writer(
        self, name: str, size: int
    ) -> AbstractContextManager[Callable[[int, memoryview], None]]:
        """A new file of ``size`` bytes held open for writes at any offset:
        ``pwrite(offset, data)``, callable from several threads at once. Leaving the
        block makes it durable where the storage syncs files. Only where
        :attr:`positional_writes`."""
        ...

    def write(self, name: str, data: bytes) -> None: ...

    def replace(self, name: str, data: bytes) -> None:
        """Write ``name`` in one step: a reader sees the file as it was or as ``data``,
        never a part of it (locally a rename over it; an object store's one ``PUT``)."""
        ...

    def remove(self, name: str) -> None: ...

    def remove_tree(self) -> None:
        """Remove this folder and everything under it (a folder of our own making that
        nobody reads any more, such as a fast step); no error when it is gone."""
        ...


@dataclass(kw_only=True)
class CollectReport:
    """What cleaning up dead runs did (or, in a dry run, would do), path by path."""

    removed: list[str] = field(default_factory=list)
    rolled_forward: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


@runtime_checkable
class Committer(Protocol):
    """Publishing a checkpoint folder atomically; the coordinator calls it, holding the
    target's lease (so no two runs ever commit at once)."""

    def check_target(self, overwrite: bool = False, foreign_ok: bool = False) -> None:
        """Raise TargetExistsError for a committed checkpoint unless ``overwrite``, and
        refuse a target where saving could destroy something that is not a checkpoint
        (unless ``foreign_ok``: a model folder, whose other files stay)."""
        ...

    def staging(self, token: str) -> Storage: ...

    def make_folder(self) -> None:
        """Create the folder (and its parents) where the store has folders; object stores
        have none, so nothing happens there."""
        ...

    def remove_folder(self) -> None:
        """Remove the folder if it is empty (a folder with any file in it stays); nothing
        on object stores."""
        ...

    def beside(self) -> dict[str, set[str]]:
        """Names of the folders in this one that runs left something beside, in the
        backend's own naming, with what: ``run`` (staging data or a commit not finished:
        :meth:`runs` of that folder has work) and ``lease`` (its lease, or what a lease
        operation killed midway left). Empty where the backend keeps both inside the
        folder (object stores)."""
        ...

    def commit(self, staging: Storage, index_bytes: bytes, replaced: Collection[str] = ()) -> None:
        """Publish ``staging`` with its index; of the old checkpoint, only the files in
        ``replaced`` (its index and data files) may be removed."""
        ...

    def abort(self, staging: Storage) -> None: ...

    def pending(self, token: str) -> bool:
        """Whether run ``token`` left something ``collect_run`` must still finish."""
        ...

    def runs(self) -> set[str]:
        """Tokens (or their 12-character prefixes) of the runs that left staging data or
        an unfinished commit beside or in this target, known by the names only reshard
        writes."""
        ...

    def collect_run(
        self,
        token: str,
        replaced: set[str] | None,
        current: set[str],
        report: CollectReport,
        *,
        owner: bool,
        dry_run: bool,
    ) -> None:
        """Clean up after dead run ``token``. ``owner``: it held the target's lease at its
        end, so a commit it decided is finished (rolled forward); a run that was not the
        owner is never rolled forward: its files are removed or left outside the target.
        ``current`` names the committed checkpoint's files (never removed)."""
        ...


class LeaseHeld(Exception):
    """The lease exists already: ``state`` is what holds it (an empty ``version`` when it
    kept vanishing between a refused create and the read: look again, never take it over)."""

    def __init__(self, state: LeaseState) -> None:
        super().__init__("the lease is held")
        self.state = state


class LeaseLost(Exception):
    """The lease is no longer the version this run knew (another run replaced it)."""


@dataclass(frozen=True)
class LeaseState:
    """The lease record as stored: its bytes, its version (what a compare-and-swap
    compares) and when the store last saw it written (None when it cannot say)."""

    record: bytes
    version: str
    modified: float | None = None


@runtime_checkable
class LeaseStore(Protocol):
    """One lease per target, changed only by compare-and-swap on its version."""

    def lease_path(self) -> str:
        """Where the lease record lives (for messages)."""
        ...

    def create_lease(self, record: bytes, token: str) -> str:
        """Create the lease atomically (only if none exists); returns its version. Raises
        :class:`LeaseHeld` with the current record when one exists."""
        ...

    def read_lease(self) -> LeaseState | None: ...

    def renew_lease(self, version: str, record: bytes) -> str:
        """Mark the lease alive again (``record`` may update it); returns the version.
        Raises :class:`LeaseLost` when it is no longer ``version``."""
        ...

    def replace_lease(self, version: str, record: bytes, token: str) -> str:
        """Take over a stale lease: replace it with ``record`` only if it is still
        ``version`` (one contender wins); returns the new version, or raises
        :class:`LeaseLost`."""
        ...

    def drop_lease(self, version: str) -> None:
        """Remove the lease if it is still ``version`` (never another run's)."""
        ...

    def remove_lease_debris(self, dry_run: bool = False) -> list[str]:
        """Remove what lease operations of dead processes left beside the lease (a
        renewal's record not yet renamed, a lease renamed aside by a release or takeover
        and not yet removed; never a live process's); returns the paths (``dry_run``: that
        would go)."""
        ...


@runtime_checkable
class Target(Storage, Committer, LeaseStore, Protocol):
    """A backend seen whole: bytes, commits and its lease (every backend is all three)."""
