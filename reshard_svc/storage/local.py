"""Local folders: positioned reads into caller buffers, staging folder + rename commit.

A save writes into ``.<name>.staging-<token>`` beside the target; commit writes the index
there, then renames the folder into place. Every data file is fsynced when it is closed,
before the index can name it (as DCP's ``sync_files=True``), and so are the index and the
folders the commit renames, so a committed checkpoint survives a power loss.
``storage_options={"sync_files": False}`` or ``RESHARD_SYNC_FILES=0`` skip every fsync
(scratch copies): the commit stays atomic against killed processes, not against a crash
of the machine. (On ext4 an fsync of the small index alone would flush most of the data
written before it, so it is skipped too.) An existing checkpoint is first renamed to
``.<name>.old-<token>`` and deleted only after the new one is in place, so it is never
destroyed before the new one commits.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import json
import logging
import mmap
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import IO, Any

from reshard_svc.errors import (
    CheckpointError,
    CorruptCheckpointError,
    TargetExistsError,
    UsageError,
)
from reshard_svc.storage.base import COMMIT_FILE as INDEX_NAME
from reshard_svc.storage.base import CollectReport
from reshard_svc.storage.fsspec_store import FsspecStorage, translate_errors
from reshard_svc.storage.local_lease import LocalLease, remove_path

__all__ = ["LocalStorage"]

logger = logging.getLogger(__name__)
_TOKEN = re.compile(r"[0-9a-f]{32}")
#: What a run leaves beside folder ``<name>``: its staging or replaced copy
#: (:meth:`LocalStorage._sibling`), its lease, and that lease's debris.
_BESIDE = re.compile(
    r"\.(?P<name>.+)\.(?:(?P<run>(?:staging|old)-[0-9a-f]{32})"
    r"|lease\.json(?P<debris>\.(?:(?P<tmp>\d+\.tmp)|(?:drop|taken)-\d+-[0-9A-Za-z_]+))?)"
)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sync_files_default() -> bool:
    """``RESHARD_SYNC_FILES`` (default on): fsync each data file before the commit."""
    value = os.environ.get("RESHARD_SYNC_FILES", "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"RESHARD_SYNC_FILES must be 1 or 0, got {value!r}")


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux's ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``: start
    writing a file's dirty pages to the disk and return without waiting (the standard
    library has no wrapper). ``None`` where the C library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, write)  # a failure here resurfaces in the closing fsync

    return start


_start_writeback = _sync_file_range()


def _pwrite_all(fd: int, path: str, offset: int, data: memoryview) -> None:
    """All of ``data`` at ``offset`` (``pwrite`` may write less than asked)."""
    view = memoryview(data).cast("B")
    with translate_errors("write", path):
        while view.nbytes:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n


def _pwrite_kicked(fd: int, path: str, offset: int, data: memoryview) -> None:
    """:func:`_pwrite_all`, then ask the disk to start writing those bytes (not waiting),
    as :class:`DurableFile` does every :attr:`~DurableFile.WRITEBACK_BYTES`: a durable file
    is not all left to its closing fsync."""
    _pwrite_all(fd, path, offset, data)
    if _start_writeback is not None:
        _start_writeback(fd, offset, memoryview(data).nbytes)


class DurableFile(io.FileIO):
    """A data file that reaches the disk before it is closed (``fsync`` in ``close``).

    Every :data:`WRITEBACK_BYTES` written, the disk is asked to start writing them
    (``sync_file_range``, not waiting), as RocksDB's ``bytes_per_sync`` and PostgreSQL's
    ``backend_flush_after`` do: the disk works while the rest of the file is produced,
    instead of receiving all of it in the closing fsync. (Left to itself, the kernel
    starts after 30 s or once a tenth of memory is dirty.) Durability rests on the fsync.

    ``discard`` (and dropping the file unclosed) closes without syncing: the file is
    abandoned with its staging folder.
    """

    WRITEBACK_BYTES = 32 * 1024 * 1024
    _written = 0  # bytes written so far (files are written front to back)
    _kicked = 0  # bytes handed to writeback so far

    def write(self, data: Any) -> int:
        n: int = super().write(data)  # type: ignore[assignment]
        self._written += n
        if _start_writeback is not None and self._written - self._kicked >= self.WRITEBACK_BYTES:
            _start_writeback(self.fileno(), self._kicked, self._written - self._kicked)
            self._kicked = self._written
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                os.fsync(self.fileno())
            finally:
                super().close()

    def discard(self) -> None:
        super().close()

    def __del__(self) -> None:
        # Dropped without close(): an abandoned file (a failed or interrupted write) is
        # not worth a sync, and a Ctrl-C landing in one would print from the finalizer.
        self.discard()


class LocalStorage(LocalLease, FsspecStorage):
    """A checkpoint folder on the local filesystem."""

    local_files = True  # memory maps, positioned reads into place, commit by rename
    positional_writes = True  # pwrite from several threads
    latency_s = 5e-5
    bandwidth = 3e9

    def __init__(
        self, uri: str, storage_options: Any = None, *, sync_files: bool | None = None
    ) -> None:
        options = dict(storage_options or {})
        sync = options.pop("sync_files", sync_files)
        if sync is None:
            sync = sync_files_default()
        if not isinstance(sync, bool):
            raise UsageError(f"storage option sync_files must be true or false, got {sync!r}")
        super().__init__(uri, options)
        self.sync_files = sync
        self.root = os.path.abspath(self.root) if self.root else os.getcwd()

    def read_view(self, name: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` as a read-only memory map of the page cache (no copy).

        The map stays valid while the view (or anything made from it) is alive. The size is
        checked first, so a truncated file is a typed error, never a SIGBUS.
        """
        path = self.path(name)
        if end <= start:
            return memoryview(b"")
        with translate_errors("read", path):
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if size < end:
                    raise CorruptCheckpointError(
                        f"{path} is truncated: reading [{start}, {end}) but the file has "
                        f"{size} bytes"
                    )
                lo = start - start % mmap.ALLOCATIONGRANULARITY
                mapped = mmap.mmap(fd, end - lo, access=mmap.ACCESS_READ, offset=lo)
            finally:
                os.close(fd)
        with contextlib.suppress(OSError, AttributeError):
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        return memoryview(mapped)[start - lo :]

    @contextlib.contextmanager
    def positional(self, name: str) -> Iterator[Callable[[int, Sequence[memoryview]], None]]:
        """The file held open for many reads: ``readv(start, runs)`` fills ``runs``
        (writable buffers, in order) from consecutive bytes at ``start``, one ``preadv``
        per ``IOV_MAX`` buffers: bytes land straight in their destination (e.g. the rows
        of a strided tensor view) with no staging copy."""
        path = self.path(name)
        with translate_errors("read", path):
            fd = os.open(path, os.O_RDONLY)
            try:
                yield functools.partial(_preadv_all, fd, path)
            finally:
                os.close(fd)

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[memoryview]:
        out = []
        for name, s, e in ranges:
            buf = memoryview(bytearray(e - s))
            with self.positional(name) as readv:
                readv(s, [buf])
            out.append(buf)
        return out

    def open_write(self, name: str) -> IO[bytes]:
        with translate_errors("write", self.path(name)):
            os.makedirs(self.root, exist_ok=True)
            if self.sync_files:
                return DurableFile(self.path(name), "wb")
            return open(self.path(name), "wb")  # noqa: SIM115 - caller closes

    @contextlib.contextmanager
    def positional_writer(
        self, name: str, size: int
    ) -> Iterator[Callable[[int, memoryview], None]]:
        """A new file of ``size`` bytes, written with ``pwrite`` from any thread; fsynced on
        leaving the block when this storage syncs files (closed unsynced on an error: the
        file is abandoned with its staging folder)."""
        path = self.path(name)
        with translate_errors("write", path):
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with translate_errors("write", path):
                os.ftruncate(fd, size)
            kick = self.sync_files and _start_writeback is not None
            yield functools.partial(_pwrite_kicked if kick else _pwrite_all, fd, path)
            if self.sync_files:
                with translate_errors("write", path):
                    os.fsync(fd)
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes) -> None:
        with translate_errors("write", self.path(name)):
            os.makedirs(self.root, exist_ok=True)
            with open(self.path(name), "wb") as f:
                f.write(data)
                f.flush()
                if self.sync_files:
                    os.fsync(f.fileno())

    def replace(self, name: str, data: bytes) -> None:
        """Written beside, then renamed over ``name`` (each writer its own temporary)."""
        path = self.path(name)
        tmp = self.path(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with translate_errors("write", path):
            os.makedirs(self.root, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    if self.sync_files:
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
        if self.sync_files:
            _fsync_dir(self.root)

    # ---- commit protocol (Committer)

    def _sibling(self, kind: str, token: str = "") -> str:
        parent, name = os.path.split(self.root)
        return os.path.join(parent, f".{name}.{kind}" + (f"-{token}" if token else ""))

    def check_target(self, overwrite: bool = False, foreign_ok: bool = False) -> None:
        """Refuse to replace a committed checkpoint (unless ``overwrite``), and to write
        into a non-empty folder that is not one (unless ``foreign_ok``: its files stay)."""
        if os.path.isdir(self.root):
            if os.path.exists(self.path(INDEX_NAME)):
                if not overwrite:
                    raise TargetExistsError(
                        f"{self.root} already holds a committed checkpoint; pass "
                        'overwrite=True (--overwrite, "overwrite": true) to replace it, '
                        "or pick a new target"
                    )
            elif os.listdir(self.root) and not foreign_ok:
                raise CheckpointError(
                    f"{self.root} exists and is not a reshard checkpoint (no {INDEX_NAME}); "
                    "refusing to replace it: pick an empty or new target"
                )
        elif os.path.exists(self.root):
            raise CheckpointError(f"{self.root} exists and is not a folder: pick another target")

    def make_folder(self) -> None:
        with translate_errors("create the folder", self.root):
            os.makedirs(self.root, exist_ok=True)

    def remove_folder(self) -> None:
        try:
            os.rmdir(self.root)
        except OSError:
            pass  # not empty (a foreign file stays), or already gone

    def beside(self) -> dict[str, set[str]]:
        """From one listing of this folder: ``run`` for a child with a staging or old
        sibling (or a lease renewal's record: its commit may be half-done), ``lease`` for
        one with a lease or lease debris beside it."""
        out: dict[str, set[str]] = {}
        for entry in self.listdir():
            m = _BESIDE.fullmatch(entry)
            if m is None:
                continue
            kinds = out.setdefault(m["name"], set())
            if m["run"] or m["tmp"]:
                kinds.add("run")
            if not m["run"]:
                kinds.add("lease")
        return out

    def staging(self, token: str) -> LocalStorage:
        return LocalStorage(self._sibling("staging", token), sync_files=self.sync_files)

    def commit(self, staging: Any, index_bytes: bytes, replaced: Collection[str] = ()) -> None:
        """Write the index into the staging folder (the commit is now decided), move the
        target's foreign files (those not in ``replaced``) into it, and swap folders."""
        token = os.path.basename(staging.root).rsplit("staging-", 1)[-1]
        replaced = set(replaced) | {INDEX_NAME}
        self._check_clash(staging.root, replaced)  # before anything is decided
        # the index's presence is the decision: written beside and renamed in, so a kill
        # mid-write leaves no torn index for a collection to roll forward
        staging.replace(INDEX_NAME, index_bytes)
        self.finish_commit(token, replaced)

    def _check_clash(self, staging: str, replaced: set[str]) -> None:
        if not os.path.isdir(self.root):
            return
        new = set(os.listdir(staging))
        clash = sorted(n for n in os.listdir(self.root) if n not in replaced and n in new)
        if clash:
            raise CheckpointError(
                f"{self.root} holds {', '.join(clash[:3])}, which the replaced checkpoint "
                "does not list but the new one writes: move it away"
            )

    def finish_commit(self, token: str, replaced: set[str] | None) -> list[str]:
        """Complete a decided commit (also after a crash; each step may already be done).
        ``replaced=None``: unknown, so everything in the target moves into the new
        checkpoint. Returns the paths kept because they could not be placed."""
        staging, old = self._sibling("staging", token), self._sibling("old", token)
        with translate_errors("commit", self.root):
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            if os.path.isdir(staging):
                if os.path.isdir(self.root):
                    new = set(os.listdir(staging))
                    foreign = [n for n in os.listdir(self.root) if n not in (replaced or ())]
                    for n in foreign:
                        if n not in new:
                            with contextlib.suppress(FileNotFoundError):
                                os.rename(os.path.join(self.root, n), os.path.join(staging, n))
                    if self.sync_files:
                        _fsync_dir(staging)
                    os.rename(self.root, old)
                os.rename(staging, self.root)
                if self.sync_files:
                    _fsync_dir(os.path.dirname(self.root))
        return self._drop_old(old, replaced)

    def _drop_old(self, old: str, replaced: set[str] | None) -> list[str]:
        """Delete the replaced checkpoint's files from ``old``; keep the folder if anything
        else is left (it is not ours to delete)."""
        if not os.path.isdir(old):
            return []
        if replaced is not None:
            for n in os.listdir(old):
                if n in replaced:
                    remove_path(os.path.join(old, n))
            with contextlib.suppress(OSError):
                os.rmdir(old)
        return [old] if os.path.isdir(old) else []

    def abort(self, staging: Any) -> None:
        """Drop uncommitted data. A staging folder that holds the index is a decided
        commit, stopped mid-swap (it may hold the target's foreign files): it stays for
        the lease's next holder or ``reshard gc`` to finish."""
        if os.path.isfile(os.path.join(staging.root, INDEX_NAME)):
            logger.warning(
                "the commit into %s stopped half way; the next run into it (or `reshard gc "
                "%s`) finishes it",
                self.root,
                self.root,
            )
            return
        shutil.rmtree(staging.root, ignore_errors=True)

    def pending(self, token: str) -> bool:
        return any(os.path.exists(self._sibling(k, token)) for k in ("staging", "old"))

    def _siblings(self) -> dict[str, dict[str, str]]:
        """token -> {kind: path} of this target's staging and old siblings."""
        parent, name = os.path.split(self.root)
        prefix = f".{name}."
        out: dict[str, dict[str, str]] = {}
        try:
            entries = os.listdir(parent)
        except FileNotFoundError:
            return out
        for entry in entries:
            if not entry.startswith(prefix):
                continue
            kind, sep, token = entry[len(prefix) :].partition("-")
            if kind in ("staging", "old") and sep and _TOKEN.fullmatch(token):
                out.setdefault(token, {})[kind] = os.path.join(parent, entry)
        return out

    def runs(self) -> set[str]:
        """Runs with a staging or old folder beside the target (names only reshard writes)."""
        return set(self._siblings())

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
        """The owner's decided commit is finished; anyone else's staging data is removed
        (of a decided one, only the files its index names); a half-swapped commit is
        rolled back."""
        del current  # a local commit is one folder swap: its state is on disk
        staging, old = self._sibling("staging", token), self._sibling("old", token)
        decided = os.path.isfile(os.path.join(staging, INDEX_NAME))
        if decided and owner:
            report.rolled_forward.append(staging)
            if not dry_run:
                report.kept += self.finish_commit(token, replaced)
            return
        if os.path.isdir(staging):
            if decided:  # not the owner's: never published, never moved in
                kept = _remove_listed(staging, dry_run)
                (report.kept if kept else report.removed).append(staging)
            else:
                report.removed.append(staging)
                if not dry_run:
                    shutil.rmtree(staging, ignore_errors=True)
        if os.path.isdir(old):
            if os.path.exists(self.root):  # the swap finished; only the cleanup did not
                if dry_run:
                    report.removed.append(old)
                else:
                    left = self._drop_old(old, replaced if owner else None)
                    report.kept += left
                    if not left:
                        report.removed.append(old)
            else:  # crashed between the two renames, before the new one was in place
                report.rolled_back.append(old)
                if not dry_run:
                    with translate_errors("roll back", self.root):
                        os.rename(old, self.root)


def _remove_listed(staging: str, dry_run: bool) -> bool:
    """Remove a decided staging folder's index and the files it names; True when other
    files are left in it (kept: they are not known to be ours)."""
    try:
        with open(os.path.join(staging, INDEX_NAME), "rb") as f:
            listed = set(json.loads(f.read()).get("files", {}))
    except (OSError, ValueError, AttributeError):
        listed = set()
    listed.add(INDEX_NAME)
    others = [n for n in os.listdir(staging) if n not in listed]
    if not dry_run:
        for n in os.listdir(staging):
            if n in listed:
                remove_path(os.path.join(staging, n))
        if not others:
            with contextlib.suppress(OSError):
                os.rmdir(staging)
    return bool(others)


def _preadv_all(fd: int, path: str, start: int, runs: Sequence[memoryview]) -> None:
    """Fill ``runs`` in order from ``fd`` at ``start``: ``preadv`` per ``IOV_MAX`` buffers,
    resuming after short reads; the end of the file first is a typed error."""
    iov_max = 1024
    pos = start
    pending = [r for r in runs if r.nbytes]
    while pending:
        batch = pending[:iov_max]
        want = sum(r.nbytes for r in batch)
        got = os.preadv(fd, batch, pos)
        if got == 0:
            raise CorruptCheckpointError(
                f"{path} is truncated: reading at {pos} hit the end of the file"
            )
        pos += got
        if got == want:
            pending = pending[len(batch) :]
            continue
        # Short read: drop what was filled, resume inside the partial buffer.
        done = 0
        while done + batch[0].nbytes <= got:
            done += batch[0].nbytes
            batch.pop(0)
            pending.pop(0)
        pending[0] = pending[0][got - done :]
