"""Any fsspec filesystem (``s3://`` through s3fs, ``memory://``, ``gs://`` ...).

Object stores have no rename, so a save writes its data files next to the committed ones
under names made unique by the save token, and the index goes last: until it is written
the previous checkpoint (its index and its files) stays whole and readable.

The lease is ``.reshard-lease.json`` in the folder. A generic fsspec store has no
conditional write, so its lease is best effort (create if absent, then read back; a
compare-and-swap reads, compares, writes); ``memory://`` does that under a process-wide
lock (its files live in this process), and S3 overrides it with conditional requests.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import IO, Any

import fsspec

from reshard_svc.errors import (
    CorruptCheckpointError,
    MissingFileError,
    ReshardError,
    StorageError,
    TargetExistsError,
    UsageError,
)
from reshard_svc.storage.base import COMMIT_FILE as INDEX_FILE
from reshard_svc.storage.base import CollectReport, LeaseHeld, LeaseLost, LeaseState

__all__ = ["FsspecStorage", "translate_errors"]

logger = logging.getLogger(__name__)

#: The lease record's name inside the folder.
LEASE_NAME = ".reshard-lease.json"
#: What data files of a checkpoint are called (tensors; opaque items).
DATA_EXTENSIONS = (".safetensors", ".bin")
#: A data file written by a run: the names reshard gives them, with the run's suffix.
_RUN_FILE = re.compile(r"^(?:shard-\d{5}-\d{3}|opaque)-([0-9a-f]{12})\.(?:safetensors|bin)$")
_MEMORY_LEASES = threading.Lock()


def _staged(name: str, suffix: str) -> bool:
    """Whether ``name`` is a data file written under a staging ``suffix``."""
    return any(name.endswith(f"{suffix}{ext}") for ext in DATA_EXTENSIONS)


@contextlib.contextmanager
def translate_errors(op: str, where: str) -> Iterator[None]:
    """Re-raise backend failures as StorageError (MissingFileError when absent)."""
    try:
        yield
    except (ReshardError, LeaseHeld, LeaseLost):
        raise
    except FileNotFoundError as e:
        raise MissingFileError(f"{op} {where}: no such file") from e
    except Exception as e:  # s3fs/aiohttp/botocore raise many unrelated types
        raise StorageError(f"{op} {where} failed: {type(e).__name__}: {e}") from e


class FsspecStorage:
    """A checkpoint folder on an fsspec filesystem."""

    #: Capabilities the runtime plans with (see :class:`~reshard_svc.storage.base.Storage`).
    local_files = False
    positional_writes = False  # an object store's upload goes front to back
    latency_s = 3e-2
    bandwidth = 5e8

    def __init__(
        self,
        uri: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        file_suffix: str = "",
        _fs: Any = None,
        _root: str | None = None,
    ) -> None:
        self.uri = uri
        self.storage_options = dict(storage_options or {})
        self.file_suffix = file_suffix
        if _fs is not None and _root is not None:
            self.fs, self.root = _fs, _root
        else:
            with translate_errors("open", uri):
                self.fs, self.root = fsspec.core.url_to_fs(uri, **self.storage_options)
        self.root = self.root.rstrip("/")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def path(self, name: str) -> str:
        return f"{self.root}/{name}" if self.root else name

    def _fresh(self) -> None:
        # Listing caches (s3fs) would hide files other processes wrote since.
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate(self.root)

    def exists(self, name: str) -> bool:
        self._fresh()
        with translate_errors("stat", self.path(name)):
            return bool(self.fs.exists(self.path(name)))

    def size(self, name: str) -> int:
        with translate_errors("stat", self.path(name)):
            return int(self.fs.size(self.path(name)))

    def modified(self, name: str) -> float | None:
        try:
            return float(self.fs.modified(self.path(name)).timestamp())
        except Exception:  # a store that does not say
            return None

    def listdir(self) -> list[str]:
        self._fresh()
        with translate_errors("list", self.root):
            try:
                entries = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
        return sorted(os.path.basename(str(e).rstrip("/")) for e in entries)

    def sizes(self) -> dict[str, int]:
        """File name -> size for every file in the folder, in one listing."""
        self._fresh()
        with translate_errors("list", self.root):
            try:
                entries = self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                return {}
        return {
            os.path.basename(str(e["name"]).rstrip("/")): int(e.get("size") or 0)
            for e in entries
            if e.get("type") != "directory"
        }

    def read(self, name: str) -> bytes:
        with translate_errors("read", self.path(name)):
            return bytes(self.fs.cat_file(self.path(name)))

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[memoryview]:
        if not ranges:
            return []
        paths = [self.path(n) for n, _, _ in ranges]
        with translate_errors("read", paths[0] if len(paths) == 1 else self.root):
            out = self.fs.cat_ranges(
                paths, [s for _, s, _ in ranges], [e for _, _, e in ranges], on_error="raise"
            )
        views = [memoryview(b) for b in out]
        for (name, s, e), v in zip(ranges, views):
            if v.nbytes != e - s:
                raise CorruptCheckpointError(
                    f"{self.path(name)} is truncated: reading [{s}, {e}) returned {v.nbytes} bytes"
                )
        return views

    def read_view(self, name: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of one file (one ranged read)."""
        (data,) = self.read_ranges([(name, start, end)])
        return data

    def root_kind(self) -> str:
        """``folder``, ``file`` or ``missing``: what the URI itself names."""
        with translate_errors("stat", self.root):
            if self.fs.isfile(self.root):
                return "file"
            return "folder" if self.fs.exists(self.root) else "missing"

    def _read_runs(self, name: str, start: int, runs: Sequence[memoryview]) -> None:
        total = sum(r.nbytes for r in runs)
        data = self.read_view(name, start, start + total)
        at = 0
        for r in runs:
            r.cast("B")[:] = data[at : at + r.nbytes]
            at += r.nbytes

    @contextlib.contextmanager
    def positional(self, name: str) -> Iterator[Callable[[int, Sequence[memoryview]], None]]:
        """Many reads of one file: ``readv(start, runs)`` fills ``runs`` (in order) from
        consecutive bytes at ``start``, one ranged read each."""
        yield functools.partial(self._read_runs, name)

    def open_write(self, name: str) -> IO[bytes]:
        with translate_errors("write", self.path(name)):
            return self.fs.open(self.path(name), "wb")  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def positional_writer(
        self, name: str, size: int
    ) -> Iterator[Callable[[int, memoryview], None]]:
        raise UsageError(f"{self.uri} takes files front to back (positional_writes is False)")
        yield  # pragma: no cover - a generator for contextmanager

    def write(self, name: str, data: bytes) -> None:
        with translate_errors("write", self.path(name)):
            self.fs.pipe_file(self.path(name), data)

    def replace(self, name: str, data: bytes) -> None:
        self.write(name, data)  # one PUT: an object store shows the old object or the new

    def remove(self, name: str) -> None:
        with translate_errors("remove", self.path(name)):
            try:
                self.fs.rm_file(self.path(name))
            except FileNotFoundError:
                pass

    def remove_tree(self) -> None:
        with translate_errors("remove", self.root):
            try:
                self.fs.rm(self.root, recursive=True)
            except FileNotFoundError:
                pass

    # ---- commit protocol (Committer)

    def check_target(self, overwrite: bool = False, foreign_ok: bool = False) -> None:
        """Refuse to replace a committed checkpoint unless ``overwrite``. Nothing else to
        refuse: a save here only adds files and never deletes foreign ones."""
        if not overwrite and self.exists(INDEX_FILE):
            raise TargetExistsError(
                f"{self.uri} already holds a committed checkpoint; pass overwrite=True "
                '(--overwrite, "overwrite": true) to replace it, or pick a new target'
            )

    def make_folder(self) -> None:
        """Object stores have no folders: a prefix exists once a file is under it."""

    def remove_folder(self) -> None:
        """Object stores have no folders to remove."""

    def beside(self) -> dict[str, set[str]]:
        """Staging data and leases live inside the target's prefix here: nothing beside."""
        return {}

    def staging(self, token: str) -> FsspecStorage:
        # Same folder, same backend class: data files get a token suffix (see module doc).
        return type(self)(
            self.uri,
            self.storage_options,
            file_suffix=f"-{token[:12]}",
            _fs=self.fs,
            _root=self.root,
        )

    def commit(self, staging: Any, index_bytes: bytes, replaced: Collection[str] = ()) -> None:
        """The index is the commit: one PUT, after every data file is complete. Then the
        data files of the ``replaced`` checkpoint that the new index does not name go."""
        try:
            self.write(INDEX_FILE, index_bytes)
        except StorageError:
            # A PUT whose answer was lost may still have taken effect.
            if not self._holds(INDEX_FILE, index_bytes):
                raise
        new = set(json.loads(index_bytes).get("files", {}))
        for name in sorted(replaced):
            if name.endswith(DATA_EXTENSIONS) and name not in new:
                try:
                    self.remove(name)
                except StorageError:  # committed; the lease lets collect() finish this
                    logger.warning("could not remove replaced %s", self.path(name))
                    self._leftovers = True

    _leftovers = False

    def _holds(self, name: str, data: bytes) -> bool:
        try:
            return self.read(name) == data
        except StorageError:
            return False

    def pending(self, token: str) -> bool:
        return self._leftovers

    def abort(self, staging: Any) -> None:
        suffix = staging.file_suffix
        if not suffix or self._holds_suffix(suffix):
            return
        for name in self.listdir():
            if _staged(name, suffix):
                with contextlib.suppress(StorageError):
                    self.remove(name)

    def _holds_suffix(self, suffix: str) -> bool:
        """Whether the committed index names files of this run (then it is committed)."""
        return any(_staged(n, suffix) for n in self._committed_files())

    def _committed_files(self) -> set[str]:
        try:
            return set(json.loads(self.read(INDEX_FILE)).get("files", {}))
        except (StorageError, ValueError, AttributeError):
            return set()

    def runs(self) -> set[str]:
        """The 12-character token prefixes of runs whose data files are in the folder but
        not in its committed index (the names only reshard gives its files)."""
        current = self._committed_files()
        return {
            m.group(1) for n in self.listdir() if (m := _RUN_FILE.match(n)) and n not in current
        }

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
        """Remove a dead run's files: its uncommitted data files and, if it was the owner
        and its commit landed (``current`` names its files), the files it replaced."""
        suffix = f"-{token[:12]}"
        names = set(self.listdir())
        doomed = {n for n in names if _staged(n, suffix) and n not in current}
        if owner and replaced and any(_staged(n, suffix) for n in current):
            doomed |= (replaced & names) - current
        for name in sorted(doomed):
            report.removed.append(self.path(name))
            if not dry_run:
                self.remove(name)

    # ---- the lease (LeaseStore)

    def lease_path(self) -> str:
        return self.path(LEASE_NAME)

    def _lease_guard(self) -> contextlib.AbstractContextManager[Any]:
        """Serialises lease changes where the store lives in this process (memory://)."""
        return (
            _MEMORY_LEASES
            if getattr(self.fs, "protocol", None) in ("memory", ("memory",))
            else contextlib.nullcontext()
        )

    def create_lease(self, record: bytes, token: str) -> str:
        with self._lease_guard():
            state = self.read_lease()
            if state is not None:
                raise LeaseHeld(state)
            self.write(LEASE_NAME, record)
            state = self.read_lease()
        if state is None or state.record != record:  # another run wrote at the same time
            raise LeaseHeld(state or LeaseState(b"", "", None))
        return state.version

    def read_lease(self) -> LeaseState | None:
        try:
            record = self.read(LEASE_NAME)
        except MissingFileError:
            return None
        return LeaseState(record, hashlib.blake2b(record, digest_size=8).hexdigest(), None)

    def renew_lease(self, version: str, record: bytes) -> str:
        return self._swap(version, record)

    def replace_lease(self, version: str, record: bytes, token: str) -> str:
        return self._swap(version, record)

    def _swap(self, version: str, record: bytes) -> str:
        with self._lease_guard():
            state = self.read_lease()
            if state is None or state.version != version:
                raise LeaseLost
            self.write(LEASE_NAME, record)
        return hashlib.blake2b(record, digest_size=8).hexdigest()

    def remove_lease_debris(self, dry_run: bool = False) -> list[str]:
        """A lease here changes in one write: nothing is left beside it."""
        return []

    def drop_lease(self, version: str) -> None:
        with self._lease_guard():
            state = self.read_lease()
            if state is not None and state.version == version:
                self.remove(LEASE_NAME)
