"""Local folders: positioned reads into caller buffers, staging folder + rename commit.

A save writes into ``.<name>.staging-<token>`` beside the target; commit writes the index
there, then renames the folder into place. An existing checkpoint is first renamed to
``.<name>.old-<token>`` and deleted only after the new one is in place, so it is never
destroyed before the new one commits.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
from collections.abc import Sequence
from typing import IO, Any

from reshard_svc.errors import CheckpointError, CorruptCheckpointError
from reshard_svc.storage.fsspec_store import FsspecStorage, translate_errors

__all__ = ["LocalStorage"]


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class LocalStorage(FsspecStorage):
    """A checkpoint folder on the local filesystem."""

    def __init__(self, uri: str, **kwargs: Any) -> None:
        super().__init__(uri, **kwargs)
        self.root = os.path.abspath(self.root) if self.root else os.getcwd()

    def read_into(self, name: str, start: int, out: memoryview) -> None:
        path = self.path(name)
        with translate_errors("read", path):
            fd = os.open(path, os.O_RDONLY)
            try:
                pos, n = 0, out.nbytes
                while pos < n:
                    got = os.preadv(fd, [out[pos:]], start + pos)
                    if got == 0:
                        raise CorruptCheckpointError(
                            f"{path} is truncated: reading [{start}, {start + n}) hit the "
                            f"end of the file after {pos} bytes"
                        )
                    pos += got
            finally:
                os.close(fd)

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

    def read_runs(self, name: str, start: int, runs: Sequence[memoryview]) -> None:
        """Fill ``runs`` (writable buffers, in order) from consecutive bytes at ``start``.

        One ``preadv`` per ``IOV_MAX`` buffers: bytes land straight in their destination
        (e.g. the rows of a strided tensor view) with no staging copy.
        """
        path = self.path(name)
        iov_max = 1024
        with translate_errors("read", path):
            fd = os.open(path, os.O_RDONLY)
            try:
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
            finally:
                os.close(fd)

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[memoryview]:
        out = []
        for name, s, e in ranges:
            buf = memoryview(bytearray(e - s))
            self.read_into(name, s, buf)
            out.append(buf)
        return out

    def open_write(self, name: str) -> IO[bytes]:
        with translate_errors("write", self.path(name)):
            os.makedirs(self.root, exist_ok=True)
            return open(self.path(name), "wb")  # noqa: SIM115 - caller closes

    def write(self, name: str, data: bytes) -> None:
        with translate_errors("write", self.path(name)):
            os.makedirs(self.root, exist_ok=True)
            with open(self.path(name), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

    # ---- commit protocol

    def _sibling(self, kind: str, token: str) -> str:
        parent, name = os.path.split(self.root)
        return os.path.join(parent, f".{name}.{kind}-{token}")

    def check_target(self, index_name: str) -> None:
        """Refuse to replace a non-empty folder that is not a checkpoint."""
        if os.path.isdir(self.root):
            if os.listdir(self.root) and not os.path.exists(self.path(index_name)):
                raise CheckpointError(
                    f"{self.root} exists and is not a reshard checkpoint (no {index_name}); "
                    "refusing to replace it: pick an empty or new target"
                )
        elif os.path.exists(self.root):
            raise CheckpointError(f"{self.root} exists and is not a folder: pick another target")

    def staging(self, token: str) -> LocalStorage:
        return LocalStorage(self._sibling("staging", token))

    def commit(self, staging: Any, index_name: str, index_bytes: bytes) -> None:
        staging.write(index_name, index_bytes)
        _fsync_dir(staging.root)
        token = os.path.basename(staging.root).rsplit("staging-", 1)[-1]
        old = self._sibling("old", token)
        with translate_errors("commit", self.root):
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            if os.path.exists(self.root):
                os.rename(self.root, old)
            os.rename(staging.root, self.root)
            _fsync_dir(os.path.dirname(self.root))
        shutil.rmtree(old, ignore_errors=True)

    def abort(self, staging: Any) -> None:
        shutil.rmtree(staging.root, ignore_errors=True)
