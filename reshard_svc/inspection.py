"""``inspect`` and ``verify``: read-only looks at a checkpoint, run by any single process.

``inspect`` reads only metadata. ``verify`` also reads every data file once, end to end:
coverage and overlaps of each tensor's chunks, byte ranges inside their files, file
sizes, safetensors headers that agree with the index, and sha256 checksums.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from reshard_svc.errors import CheckpointError, MissingFileError, StorageError
from reshard_svc.index import CheckpointIndex
from reshard_svc.sources import open_checkpoint, read_header
from reshard_svc.storage import FsspecStorage, open_storage

__all__ = ["VerifyReport", "describe_index", "inspect", "verify"]

HASH_BLOCK = 16 * 1024 * 1024


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
    }


@dataclass
class VerifyReport:
    uri: str
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_hashed: int = 0
    tensors: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "ok": self.ok,
            "problems": self.problems,
            "files_checked": self.files_checked,
            "bytes_hashed": self.bytes_hashed,
            "tensors": self.tensors,
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
    report = VerifyReport(uri)
    try:
        storage = open_storage(uri, storage_options)
        _, index = open_checkpoint(storage)
    except (CheckpointError, StorageError) as e:
        report.problems.append(f"{type(e).__name__}: {e}")
        return report
    report.tensors = len(index.tensors)
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for t in index.tensors.values():
        for c in t.chunks:
            by_file.setdefault(c.file, []).append((t, c))
    total = sum(m.size for m in index.files.values())

    def check_one(name: str) -> tuple[list[str], int]:
        part = VerifyReport(uri)
        try:
            _verify_file(storage, name, index.files[name], by_file.get(name, []), part)
        except MissingFileError:
            part.problems.append(f"{name}: data file is missing")
        except (CheckpointError, StorageError) as e:
            part.problems.append(f"{name}: {e}")
        return part.problems, part.bytes_hashed

    # Files hash in parallel (hashlib and reads release the GIL); results keep file order.
    done = 0
    names = sorted(index.files)
    with ThreadPoolExecutor(max(1, min(workers, len(names) or 1))) as pool:
        for name, (problems, hashed) in zip(names, pool.map(check_one, names)):
            report.problems.extend(problems)
            report.bytes_hashed += hashed
            report.files_checked += 1
            done += index.files[name].size
            if progress is not None:
                progress(done, total)
    return report


def _verify_file(
    storage: FsspecStorage,
    name: str,
    meta: Any,
    chunks: list[tuple[Any, Any]],
    report: VerifyReport,
) -> None:
    size = storage.size(name)
    if size != meta.size:
        report.problems.append(f"{name}: size is {size} bytes, the index says {meta.size}")
        return
    if not name.endswith(".safetensors"):
        return  # DCP .distcp items: size only (no header, no checksum in the metadata)
    header = read_header(storage, name, size)
    for t, c in chunks:
        entry = header.entries.get(t.name)
        if entry is None:
            report.problems.append(f"{name}: has no tensor {t.name!r} that the index places there")
            continue
        if (
            entry.dtype != t.dtype
            or entry.shape != c.box.sizes
            or (entry.begin, entry.end)
            != (
                c.begin,
                c.end,
            )
        ):
            report.problems.append(
                f"{name}: header of {t.name!r} ({entry.dtype}, {list(entry.shape)}, "
                f"[{entry.begin}, {entry.end})) disagrees with the index ({t.dtype}, "
                f"{list(c.box.sizes)}, [{c.begin}, {c.end}))"
            )
    if meta.sha256 is None:
        return
    sha = hashlib.sha256()
    for start in range(0, size, HASH_BLOCK):
        (block,) = storage.read_ranges([(name, start, min(size, start + HASH_BLOCK))])
        sha.update(block)
        report.bytes_hashed += block.nbytes
    if sha.hexdigest() != meta.sha256:
        report.problems.append(
            f"{name}: sha256 mismatch (file {sha.hexdigest()[:16]}…, index {meta.sha256[:16]}…)"
        )
