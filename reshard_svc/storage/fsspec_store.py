"""Any fsspec filesystem (``s3://`` through s3fs, ``memory://``, ``gs://`` ...).

Object stores have no rename, so a save writes its data files next to the committed ones
under names made unique by the save token, and the index goes last: until it is written
the previous checkpoint (its index and its files) stays whole and readable.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

import fsspec

from reshard_svc.errors import (
    CorruptCheckpointError,
    MissingFileError,
    ReshardError,
    StorageError,
)

__all__ = ["FsspecStorage", "translate_errors"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def translate_errors(op: str, where: str) -> Iterator[None]:
    """Re-raise backend failures as StorageError (MissingFileError when absent)."""
    try:
        yield
    except ReshardError:
        raise
    except FileNotFoundError as e:
        raise MissingFileError(f"{op} {where}: no such file") from e
    except Exception as e:  # s3fs/aiohttp/botocore raise many unrelated types
        raise StorageError(f"{op} {where} failed: {type(e).__name__}: {e}") from e


class FsspecStorage:
    """A checkpoint folder on an fsspec filesystem."""

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

    def read_into(self, name: str, start: int, out: memoryview) -> None:
        (data,) = self.read_ranges([(name, start, start + out.nbytes)])
        out[:] = data

    def open_write(self, name: str) -> IO[bytes]:
        with translate_errors("write", self.path(name)):
            return self.fs.open(self.path(name), "wb")  # type: ignore[no-any-return]

    def write(self, name: str, data: bytes) -> None:
        with translate_errors("write", self.path(name)):
            self.fs.pipe_file(self.path(name), data)

    def remove(self, name: str) -> None:
        with translate_errors("remove", self.path(name)):
            try:
                self.fs.rm_file(self.path(name))
            except FileNotFoundError:
                pass

    # ---- commit protocol

    def check_target(self, index_name: str) -> None:
        """Nothing to refuse: a save here only adds files and never deletes foreign ones."""

    def staging(self, token: str) -> FsspecStorage:
        # Same folder, same backend class: data files get a token suffix (see module doc).
        return type(self)(
            self.uri,
            self.storage_options,
            file_suffix=f"-{token[:12]}",
            _fs=self.fs,
            _root=self.root,
        )

    def commit(self, staging: Any, index_name: str, index_bytes: bytes) -> None:
        # The index is the commit: one PUT, after every data file is complete.
        self.write(index_name, index_bytes)

    def abort(self, staging: Any) -> None:
        suffix = staging.file_suffix
        if not suffix:
            return
        for name in self.listdir():
            if name.endswith(f"{suffix}.safetensors"):
                with contextlib.suppress(StorageError):
                    self.remove(name)
