"""``inspect`` and ``verify``: read-only looks at a checkpoint, run by any single process.

``inspect`` reads only metadata. ``verify`` also reads every data file once, end to end:
coverage and overlaps of each tensor's chunks, byte ranges inside their files, file
sizes, safetensors headers that agree with the index, every block's CRC32C (spans of
blocks checked on parallel threads) and, where recorded, the whole-file sha256.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from reshard_svc.errors import (
    CheckpointError,
    ChecksumError,
    MissingFileError,
    StateDictError,
    StorageError,
)
from reshard_svc.format.index import CheckpointIndex, FileMeta
from reshard_svc.format.reader import SPAN, DataCheck, read_header
from reshard_svc.format.readers import open_checkpoint, source_of
from reshard_svc.storage import Storage, open_storage

__all__ = ["VerifyReport", "describe_index", "inspect", "read_blob", "verify"]


def inspect(uri: str, storage_options: Mapping[str, Any] | None = None) -> CheckpointIndex:
    """Describe a checkpoint: tensors (dtype, shape, layout, chunks), files, extras."""
    _, index = open_checkpoint(uri, dict(storage_options or {}))
    return index


def describe_index(index: CheckpointIndex, uri: str = "") -> dict[str, Any]:
    """JSON-able summary of an index (what ``reshard inspect --json`` prints)."""
    return {
        "uri": uri,
        "source": index.source,
        "tensors_count": len(index.tensors),
        "total_bytes": index.total_bytes,
        "files_count": len(index.files),
        "tensors": {
            name: {**t.to_json(), "nbytes": t.nbytes} for name, t in sorted(index.tensors.items())
        },
        "files": {k: v.to_json() for k, v in sorted(index.files.items())},
        "extras": index.extras,
        "blobs": {k: {**b.to_json(), "nbytes": b.nbytes} for k, b in sorted(index.blobs.items())},
    }


def read_blob(uri: str, name: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The stored bytes of opaque item ``name`` (checked against their block CRCs).

    They are returned as bytes and never deserialized here. A ``torch_save`` item is a
    pickle: only ``torch.load(io.BytesIO(data), weights_only=True)`` it, or load it fully
    only if you trust where the checkpoint came from.
    """
    storage, index = open_checkpoint(uri, dict(storage_options or {}))
    blob = index.blobs.get(name)
    if blob is None:
        raise StateDictError(
            f"{uri} has no opaque item {name!r} (it has: {', '.join(sorted(index.blobs)) or 'none'})"
        )
    table = index.block_tables().get(blob.file)
    lo, hi = table.widen(blob.begin, blob.end) if table else (blob.begin, blob.end)
    data = storage.read_view(blob.file, lo, hi)
    if table:
        table.check(lo, data)
    return bytes(data[blob.begin - lo : blob.end - lo])


@dataclass(kw_only=True)
class VerifyReport:
    """What :func:`verify` found at ``uri``: ``ok`` when ``problems`` is empty. How much it
    checked (files, bytes hashed, tensors), what the checkpoint records, and the bytes no
    checksum covers, with why."""

    uri: str
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_hashed: int = 0
    tensors: int = 0
    #: what the checkpoint records: crc32c, sha256 (crc32c blocks + sha256) or none
    checksum: str = "none"
    #: data bytes no checksum covers (only sizes, headers and coverage were checked)
    bytes_unchecked: int = 0
    #: why those bytes could not be checked, one line per reason
    unchecked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem found (in what could be checked: see :attr:`complete`)."""
        return not self.problems

    @property
    def complete(self) -> bool:
        """No problem found and every data byte checked against a recorded checksum."""
        return self.ok and not self.bytes_unchecked

    def to_json(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "ok": self.ok,
            "problems": self.problems,
            "files_checked": self.files_checked,
            "bytes_hashed": self.bytes_hashed,
            "tensors": self.tensors,
            "checksum": self.checksum,
            "complete": self.complete,
            "bytes_unchecked": self.bytes_unchecked,
            "unchecked": self.unchecked,
        }


def verify(
    uri: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    workers: int = max(1, min(8, os.cpu_count() or 1)),
) -> VerifyReport:
    """Check a checkpoint end to end; problems are listed, not raised. ``workers`` files
    are checked at once."""
    report = VerifyReport(uri=uri)
    try:
        storage = open_storage(uri, storage_options)
        _, index = open_checkpoint(storage)
    except (CheckpointError, StorageError) as e:
        report.problems.append(f"{type(e).__name__}: {e}")
        return report
    return _Verification(storage, index, report, progress).run(workers)


#: One check of a data file's bytes: (file, the source's own check or None for the
#: index's blocks and sha256, begin, end).
_Task = tuple[str, DataCheck | None, int, int]


class _Verification:
    """One ``verify``: each file's structure first (sizes, headers), then its data in
    tasks (spans of blocks, or whole files when a sha256 must be computed in order, or the
    source's own check) on a thread pool; CRC32C, sha256 and reads release the GIL.
    Problems are reported in file order."""

    def __init__(
        self,
        storage: Storage,
        index: CheckpointIndex,
        report: VerifyReport,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.storage, self.index, self.report = storage, index, report
        self.source = source_of(index)
        report.tensors = len(index.tensors)
        report.checksum = self.source.checksum(index)
        self.by_file: dict[str, list[tuple[Any, Any]]] = {}
        for t in index.tensors.values():
            for c in t.chunks:
                self.by_file.setdefault(c.file, []).append((t, c))
        self.advance = _Tally(sum(m.size for m in index.files.values()), progress)
        self.problems: dict[str, list[str]] = {n: [] for n in sorted(index.files)}

    def run(self, workers: int) -> VerifyReport:
        tasks = [task for name in self.problems for task in self.tasks(name)]
        with ThreadPoolExecutor(max(1, min(workers, len(tasks) or 1))) as pool:
            for name, found, hashed in pool.map(self.check, tasks):
                self.problems[name].extend(found)
                self.report.bytes_hashed += hashed
        for found in self.problems.values():
            self.report.problems.extend(found)
        if not self.report.problems:
            self.report.problems.extend(self.source.verify_more(self.storage, self.index))
        return self.report

    def tasks(self, name: str) -> list[_Task]:
        """The checks of one file's bytes once its structure passed; a file nothing
        records checksums for is counted unchecked, with the source's reason."""
        meta = self.index.files[name]
        ok = self.structure(name, meta)
        self.report.files_checked += 1
        own = self.source.data_check(name, meta) if ok else None
        if own is not None:
            return [(name, own, 0, meta.size)]
        if not ok or (meta.blocks is None and meta.sha256 is None):
            if ok:
                self.report.bytes_unchecked += meta.size
                reason = self.source.unchecked(self.index)
                if reason not in self.report.unchecked:
                    self.report.unchecked.append(reason)
            self.advance(meta.size)
            return []
        if meta.sha256 is not None or meta.blocks is None:
            return [(name, None, 0, meta.size)]
        step = max(meta.blocks.block_size, SPAN - SPAN % meta.blocks.block_size)
        return [(name, None, a, min(meta.size, a + step)) for a in range(0, meta.size, step)]

    def structure(self, name: str, meta: FileMeta) -> bool:
        """Size and header checks; False when the data cannot be checked further."""
        out = self.problems[name]
        try:
            return _verify_structure(self.storage, name, meta, self.by_file.get(name, []), out)
        except MissingFileError:
            out.append(f"{name}: data file is missing")
        except (CheckpointError, StorageError) as e:
            out.append(f"{name}: {e}")
        return False

    def check(self, task: _Task) -> tuple[str, list[str], int]:
        name, own, lo, hi = task
        found: list[str] = []
        try:
            if own is not None:
                hashed = own(self.storage, name, hi, found, self.advance)
            else:
                meta = self.index.files[name]
                hashed = _check_data(self.storage, name, meta, lo, hi, found, self.advance)
        except (CheckpointError, StorageError) as e:
            found.append(f"{name}: {e}")
            hashed = 0
        return name, found, hashed


class _Tally:
    """Bytes checked so far, from several threads, reported to ``progress(done, total)``."""

    def __init__(self, total: int, progress: Callable[[int, int], None] | None) -> None:
        self.total, self.progress, self.done = total, progress, 0
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.progress is not None:
                self.progress(self.done, self.total)


def _verify_structure(
    storage: Storage, name: str, meta: Any, chunks: list[tuple[Any, Any]], out: list[str]
) -> bool:
    """Size and header checks; False when the data cannot be checked further."""
    size = storage.size(name)
    if size != meta.size:
        out.append(f"{name}: size is {size} bytes, the index says {meta.size} (truncated?)")
        return False
    if not name.endswith(".safetensors"):
        return True  # DCP .distcp items: size only (no header, no checksum in the metadata)
    header = read_header(storage, name, size)
    for t, c in chunks:
        entry = header.entries.get(t.name)
        if entry is None:
            out.append(f"{name}: has no tensor {t.name!r} that the index places there")
            continue
        if (entry.dtype, entry.shape, entry.begin, entry.end) != (
            t.dtype,
            c.box.sizes,
            c.begin,
            c.end,
        ):
            out.append(
                f"{name}: header of {t.name!r} ({entry.dtype}, {list(entry.shape)}, "
                f"[{entry.begin}, {entry.end})) disagrees with the index ({t.dtype}, "
                f"{list(c.box.sizes)}, [{c.begin}, {c.end}))"
            )
    return True


def _check_data(
    storage: Storage,
    name: str,
    meta: Any,
    lo: int,
    hi: int,
    out: list[str],
    advance: Callable[[int], None],
) -> int:
    """Check blocks (and sha256, when ``[lo, hi)`` is the whole file) of one span."""
    sha = hashlib.sha256() if meta.sha256 is not None else None
    step = meta.blocks.block_size if meta.blocks is not None else SPAN
    if meta.blocks is not None:
        step *= max(1, (16 * 1024 * 1024) // step)
    checked = 0
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        view = storage.read_view(name, a, b)
        if meta.blocks is not None:
            try:
                meta.blocks.check(a, view)
            except ChecksumError:
                # Name every bad block of this piece, not only the first.
                bs = meta.blocks.block_size
                for k in range(a, b, bs):
                    try:
                        meta.blocks.check(k, view[k - a : min(b, k + bs) - a])
                    except ChecksumError as e:
                        out.append(str(e))
        if sha is not None:
            sha.update(view)
        checked += b - a
        advance(b - a)
        del view
    if sha is not None and sha.hexdigest() != meta.sha256:
        out.append(
            f"{name}: sha256 mismatch (file {sha.hexdigest()[:16]}…, index {meta.sha256[:16]}…)"
        )
    return checked
