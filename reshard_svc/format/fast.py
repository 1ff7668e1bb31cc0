"""The fast tier on a node's local path (tmpfs): fast steps, their parts and commit records.

One node's fast path holds, per fast step of a run, the *parts* its ranks wrote and the
copies of other nodes' parts it received::

    /dev/shm/reshard/run-7/
        step-0000000120.3f2a9c1d/          a fast step of run 3f2a9c1d...
            part-00003/                    rank 3's shards: our format (safetensors, a
                reshard.index.json           partial index of its boxes, block CRC32Cs)
            part-00001/                    a copy of rank 1's part (rank 1 is on another node)
            commit.json                    the step counts: every part has all its copies

A part is published like any checkpoint of ours (staging beside it, index last, rename),
so a part folder with an index is whole. ``commit.json`` is written on every node only
after every rank agreed that every part has all its copies; a step folder without it is
an unfinished save, never read. The run's token in the folder name keeps two runs that
reach the same step number (a job resumed from an older step) apart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import posixpath
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reshard_svc.errors import CheckpointError, ReshardError, StorageError, UsageError
from reshard_svc.format.index import INDEX_NAME, CheckpointIndex
from reshard_svc.format.steps import StepInfo, parse_fast_step, step_name
from reshard_svc.storage import open_storage
from reshard_svc.storage.base import Target

__all__ = [
    "COMMIT_RECORD",
    "FastStep",
    "check_part",
    "fast_steps",
    "local_root",
    "make_step_folder",
    "pack_part",
    "part_folder",
    "part_name",
    "part_target",
    "read_part",
    "remove_fast_step",
    "remove_part",
    "unpack_part",
    "write_commit",
]

logger = logging.getLogger(__name__)

COMMIT_RECORD = "commit.json"
_PART = re.compile(r"part-(\d{5,})")


def part_name(rank: int) -> str:
    return f"part-{rank:05d}"


@dataclass(frozen=True, kw_only=True, eq=False)
class FastStep(StepInfo):
    """One fast step folder on this node: the step record every listing shows (tier
    ``fast``; its size filled in by :meth:`info`), with what the fast tier reads it by:
    the run that saved it, the folder, its commit record (None while unfinished) and the
    parts it holds whole (origin rank -> folder)."""

    run: str
    folder: str
    record: dict[str, Any] | None
    parts: dict[int, str] = field(default_factory=dict)
    tier: str = "fast"

    def info(self, sizes: bool = True) -> StepInfo:
        """This step as ``reshard steps`` lists it, with its bytes (the fast tier keeps
        its newest two itself: no policy)."""
        return dataclasses.replace(self, bytes=self.nbytes()) if sizes else self

    def nbytes(self) -> int:
        """Bytes of the folder's files (the record, its parts and their copies)."""
        try:
            folders = [self.folder, *self.parts.values()]
            return sum(sum(_storage(f).sizes().values()) for f in folders)
        except ReshardError:
            return 0  # removed meanwhile


def local_root(path: str) -> str:
    """The fast path as a local folder (a plain path or ``file://``)."""
    if not isinstance(path, str) or not path:
        raise UsageError(f"FastTier path must be a local folder, got {path!r}")
    if "://" in path and not path.startswith("file://"):
        raise UsageError(
            f"FastTier path {path!r} must be a local folder on each node (tmpfs such as "
            "/dev/shm/...), not a remote store: the persistent root is the remote tier"
        )
    return _storage(path).root


def fast_steps(path: str) -> list[FastStep]:
    """Every fast step folder under ``path``, oldest first (unreadable records count as
    unfinished)."""
    root = local_root(path)
    out = []
    now = time.time()
    for name in _storage(root).listdir():
        named = parse_fast_step(name)
        if named is None:
            continue
        folder = posixpath.join(root, name)
        step = _storage(folder)
        try:
            loaded = json.loads(step.read(COMMIT_RECORD))
            record = loaded if isinstance(loaded, dict) else None
        except (ReshardError, ValueError):
            record = None
        parts = {}
        try:
            entries = step.listdir()
        except ReshardError:
            entries = []
        for entry in entries:
            p = _PART.fullmatch(entry)
            part = posixpath.join(folder, entry)
            if p is not None and _storage(part).exists(INDEX_NAME):
                parts[int(p.group(1))] = part
        out.append(
            FastStep(
                step=named[0],
                name=name,
                committed=record is not None,
                bytes=0,
                age_s=max(0.0, now - float(record.get("time", now))) if record else None,
                run=named[1],
                folder=folder,
                record=record,
                parts=parts,
            )
        )
    return sorted(out, key=lambda s: (s.step, s.run))


def make_step_folder(path: str, step: int, run: str) -> str:
    """Run ``run``'s folder for fast step ``step`` under ``path``, made."""
    folder = posixpath.join(local_root(path), step_name(step, run))
    _storage(folder).make_folder()
    return folder


def part_folder(step_folder: str, rank: int) -> str:
    return posixpath.join(step_folder, part_name(rank))


def remove_part(step_folder: str, rank: int) -> None:
    """Remove rank ``rank``'s part of an unfinished fast step (a save of it runs again)."""
    try:
        _storage(part_folder(step_folder, rank)).remove_tree()
    except ReshardError as e:
        logger.warning("could not remove rank %d's part under %s: %s", rank, step_folder, e)


def pack_part(step_folder: str, rank: int) -> bytearray:
    """A published part as one message: a JSON manifest (file names and sizes), then the
    files, the index last (read once, straight into the message)."""
    folder = part_folder(step_folder, rank)
    index = read_part(folder)
    storage = _storage(folder)
    names = [*sorted(index.files), INDEX_NAME]
    listed = storage.sizes()
    sizes = [listed.get(n, -1) for n in names]
    if -1 in sizes:
        raise CheckpointError(f"{folder}: {names[sizes.index(-1)]} is gone")
    manifest = json.dumps([[n, s] for n, s in zip(names, sizes)]).encode()
    head = len(manifest).to_bytes(8, "big") + manifest
    out = bytearray(len(head) + sum(sizes))
    out[: len(head)] = head
    view, at = memoryview(out), len(head)
    for n, size in zip(names, sizes):
        if size:
            with storage.positional(n) as readv:  # read once, straight into the message
                readv(0, [view[at : at + size]])
        at += size
    return out


def unpack_part(step_folder: str, rank: int, blob: memoryview) -> None:
    """Check every block of a received part against its own index, then publish it as
    rank ``rank``'s part (staging beside it, index last, rename)."""
    blob = memoryview(blob).cast("B")
    n = int.from_bytes(blob[:8], "big")
    try:
        manifest = json.loads(bytes(blob[8 : 8 + n]))
    except ValueError as e:
        raise CheckpointError(f"a malformed part message: {e}") from None
    at = 8 + n
    files: dict[str, memoryview] = {}
    for name, size in manifest:
        files[str(name)] = blob[at : at + int(size)]
        at += int(size)
    if at != len(blob) or INDEX_NAME not in files:
        raise CheckpointError("a malformed part message")
    index_bytes = bytes(files.pop(INDEX_NAME))
    index = CheckpointIndex.loads(index_bytes, f"rank {rank}'s part")
    if set(index.files) != set(files):
        raise CheckpointError("the part's files are not the ones its index names")
    for name, meta in index.files.items():
        if meta.blocks is None or meta.size != files[name].nbytes:
            raise CheckpointError(f"{name}: its size or CRC32Cs are missing")
        if meta.size:
            meta.blocks.check(0, files[name])
    target = part_target(step_folder, rank)
    staging = target.staging(uuid.uuid4().hex)
    for name, data in files.items():  # views of the message: written without a copy
        staging.write(name, data)  # type: ignore[arg-type]
    target.commit(staging, index_bytes)


def check_part(folder: str) -> CheckpointIndex:
    """Every block of a part's files against its index (sizes too); its index."""
    index = read_part(folder)
    storage = _storage(folder)
    for name, meta in index.files.items():
        if meta.blocks is None:
            raise CheckpointError(f"{name} has no block CRC32Cs")
        size = storage.size(name)
        if size != meta.size:
            raise CheckpointError(f"{name} is {size} bytes, not {meta.size}")
        if meta.size:
            meta.blocks.check(0, storage.read_view(name, 0, meta.size))
    return index


def part_target(step_folder: str, rank: int) -> Target:
    """Where origin rank ``rank``'s part of a fast step is published."""
    return _storage(part_folder(step_folder, rank))


def read_part(folder: str) -> CheckpointIndex:
    """A part's index (it covers only the boxes its rank held)."""
    return CheckpointIndex.loads(_storage(folder).read(INDEX_NAME), f"{folder}/{INDEX_NAME}")


def write_commit(step_folder: str, record: Mapping[str, Any]) -> None:
    """The step counts on this node (every rank of a node may write the same record)."""
    try:
        _storage(step_folder).replace(COMMIT_RECORD, json.dumps(dict(record)).encode())
    except ReshardError as e:
        raise StorageError(f"could not write the fast step's record in {step_folder}: {e}") from e


def remove_fast_step(step: FastStep) -> None:
    """Remove a fast step folder of ours (named by :func:`step_name` with its run): its
    record first, so nobody reads a step being removed."""
    if parse_fast_step(posixpath.basename(step.folder)) is None:  # pragma: no cover
        raise CheckpointError(f"{step.folder} is not a fast step folder")
    folder = _storage(step.folder)
    try:
        folder.remove(COMMIT_RECORD)
    except ReshardError as e:
        logger.warning("could not remove %s: %s", step.folder, e)
        return
    try:
        folder.remove_tree()
    except ReshardError as e:
        logger.warning("could not remove all of %s: %s", step.folder, e)


def _storage(folder: str) -> Target:
    """A folder of the fast path (node memory: nothing of it is fsynced)."""
    return open_storage(folder, {"sync_files": False})
