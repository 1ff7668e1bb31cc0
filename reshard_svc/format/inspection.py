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
from reshard_svc.format.index import CheckpointIndex
from reshard_svc.format.reader import SPAN, read_header
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
    source = source_of(index)
    report.tensors = len(index.tensors)
    report.checksum = source.checksum(index)
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for t in index.tensors.values():
        for c in t.chunks:
            by_file.setdefault(c.file, []).append((t, c))
    advance = _Tally(sum(m.size for m in index.files.values()), progress)

    # Structure first (sizes, headers), then the data: spans of blocks (or whole files
    # when a sha256 must be computed in order) on a thread pool; CRC32C, sha256 and
    # reads release the GIL. Problems are reported in file order.
    names = sorted(index.files)
    problems: dict[str, list[str]] = {n: [] for n in names}
    tasks: list[tuple[str, int, int]] = []
    own: dict[str, Any] = {}  # the source's own check of a file's bytes
    for name in names:
        meta = index.files[name]
        try:
            ok = _verify_structure(storage, name, meta, by_file.get(name, []), problems[name])
        except MissingFileError:
            problems[name].append(f"{name}: data file is missing")
            ok = False
        except (CheckpointError, StorageError) as e:
            problems[name].append(f"{name}: {e}")
            ok = False
        report.files_checked += 1
        own_check = source.data_check(name, meta) if ok else None
        if own_check is not None:
            own[name] = own_check
            tasks.append((name, -1, meta.size))
            continue
        if not ok or (meta.blocks is None and meta.sha256 is None):
            if ok:
                report.bytes_unchecked += meta.size
                reason = source.unchecked(index)
                if reason not in report.unchecked:
                    report.unchecked.append(reason)
            advance(meta.size)
            continue
        if meta.sha256 is not None or meta.blocks is None:
            tasks.append((name, 0, meta.size))
        else:
            step = max(meta.blocks.block_size, SPAN - SPAN % meta.blocks.block_size)
            tasks.extend((name, a, min(meta.size, a + step)) for a in range(0, meta.size, step))

    def check(task: tuple[str, int, int]) -> tuple[str, list[str], int]:
        name, lo, hi = task
        found: list[str] = []
        try:
            if lo < 0:
                hashed = own[name](storage, name, hi, found, advance)
            else:
                hashed = _check_data(storage, name, index.files[name], lo, hi, found, advance)
        except (CheckpointError, StorageError) as e:
            found.append(f"{name}: {e}")
            hashed = 0
        return name, found, hashed

    with ThreadPoolExecutor(max(1, min(workers, len(tasks) or 1))) as pool:
        for name, found, hashed in pool.map(check, tasks):
            problems[name].extend(found)
            report.bytes_hashed += hashed
    for name in names:
        report.problems.extend(problems[name])
    if not report.problems:
        report.problems.extend(source.verify_more(storage, index))
    return report


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
