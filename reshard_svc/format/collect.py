"""Leases on in-progress saves, and garbage collection of what interrupted runs left.

Every save and convert holds a *lease* on its target from before its first data file is
written until after its commit or abort: a small JSON record (token, owner, host, pid,
expiry) written beside the checkpoint and renewed by a heartbeat thread. A run that dies
leaves its lease behind, and the lease says which leftovers are its own:

* local folders: ``.<name>.staging-<token>`` (data not yet committed, or a commit that was
  decided but not finished) and ``.<name>.old-<token>`` (the checkpoint being replaced);
* object stores: data files named ``*-<token[:12]>.safetensors`` that no index refers to,
  and, after an interrupted overwrite, the replaced checkpoint's files.

:func:`collect` removes the leftovers of every run whose lease is *stale*: expired (no
heartbeat for :data:`LEASE_TTL_S`), or held by a process on this host that no longer exists
(or is a zombie),
or held by the ``owner`` the caller names (the server, once it knows a job's workers are
gone). A live lease is never touched. A local commit that was interrupted is rolled
forward when its staging folder holds the new index, and rolled back otherwise. Files that
are not part of a checkpoint are never deleted.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from reshard_svc.errors import CheckpointError
from reshard_svc.format.index import INDEX_NAME, CheckpointIndex
from reshard_svc.format.sources import HF_INDEX
from reshard_svc.storage import Storage, open_storage

__all__ = [
    "LEASE_TTL_S",
    "GcReport",
    "Lease",
    "LeaseRecord",
    "TargetRun",
    "collect",
    "replaced_files",
]

logger = logging.getLogger(__name__)

#: A lease whose heartbeat is older than this is stale (seconds).
LEASE_TTL_S = float(os.environ.get("RESHARD_LEASE_TTL_S", "120"))
#: How often the holder renews its lease (seconds).
HEARTBEAT_S = max(1.0, LEASE_TTL_S / 6)
#: Env var naming the lease owner (the server sets ``reshard-job-<id>``).
OWNER_ENV = "RESHARD_LEASE_OWNER"


def default_owner() -> str:
    job = os.environ.get("RESHARD_JOB_ID")
    return os.environ.get(OWNER_ENV) or (f"reshard-job-{job}" if job else "")


@dataclass
class LeaseRecord:
    token: str
    kind: str
    owner: str
    host: str
    pid: int
    started: float
    expires: float
    #: Files of the checkpoint this run replaces (set just before its commit).
    replaces: list[str] = field(default_factory=list)

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def loads(cls, raw: bytes, token: str) -> LeaseRecord | None:
        """The record, or None when it is unreadable (a torn write: treated as stale)."""
        try:
            data = json.loads(raw)
            rec = cls(
                token=str(data["token"]),
                kind=str(data["kind"]),
                owner=str(data.get("owner", "")),
                host=str(data["host"]),
                pid=int(data["pid"]),
                started=float(data["started"]),
                expires=float(data["expires"]),
                replaces=[str(n) for n in data.get("replaces", [])],
            )
        except (ValueError, KeyError, TypeError):
            return None
        return rec if rec.token == token else None

    def stale(self, now: float, owner: str | None = None) -> bool:
        if owner and self.owner == owner:
            return True
        if self.expires < now:
            return True
        return self.host == socket.gethostname() and not _alive(self.pid)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs. A zombie does not: a worker killed
    with its launcher is reparented to PID 1, and in a container whose PID 1 does not reap
    (no ``--init``) it stays a zombie, which ``kill(pid, 0)`` still finds."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # gone since kill(); or no /proc here
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


class Lease:
    """Held by a save's or convert's coordinator from before its first write until its
    commit or abort; renewed every :data:`HEARTBEAT_S` by a daemon thread."""

    def __init__(self, storage: Storage, token: str, kind: str) -> None:
        now = time.time()
        self.storage = storage
        self.record = LeaseRecord(
            token, kind, default_owner(), socket.gethostname(), os.getpid(), now,
            now + LEASE_TTL_S,
        )  # fmt: skip
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._write()
        self._thread = threading.Thread(target=self._beat, name="reshard-lease", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        with self._lock:
            self.record.expires = time.time() + LEASE_TTL_S
            self.storage.write_lease(self.record.token, self.record.dumps())

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except Exception:  # a missed heartbeat only shortens the lease
                logger.warning("could not renew the lease on %s", self.storage.uri, exc_info=True)

    def replacing(self, files: set[str]) -> None:
        """Record what the commit will replace, so a crash mid-commit can be finished."""
        self.record.replaces = sorted(files)
        self._write()

    def release(self, remove: bool = True) -> None:
        """Stop renewing; ``remove=False`` leaves the record to expire, so that ``collect``
        later finishes what this run could not (its record says what it replaced)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if not remove:
            return
        try:
            self.storage.remove_lease(self.record.token)
        except Exception:  # it expires on its own
            logger.warning("could not remove the lease on %s", self.storage.uri, exc_info=True)


def replaced_files(storage: Storage) -> set[str]:
    """The files a commit at ``storage`` replaces: the committed checkpoint's data files
    and index (and its HF index, if it is an HF export). Empty when nothing is committed."""
    if not storage.exists(INDEX_NAME):
        return set()
    try:
        index = CheckpointIndex.loads(storage.read(INDEX_NAME))
    except CheckpointError:
        return {INDEX_NAME}
    files = set(index.files) | {INDEX_NAME}
    if index.tensors and all(t.layout is None for t in index.tensors.values()):
        files.add(HF_INDEX)  # an HF export: its model.safetensors.index.json is ours
    return files


class TargetRun:
    """The coordinator's hold on a save's or convert's target: it checks the target,
    collects what earlier dead runs left, takes a lease, and then commits or aborts.

    Created by rank 0 only, before any rank writes a data file.
    """

    def __init__(self, storage: Storage, kind: str, overwrite: bool = False) -> None:
        storage.check_target(INDEX_NAME, overwrite)
        try:
            collect(storage)
        except Exception:  # housekeeping never fails the run itself
            logger.warning("could not collect leftovers at %s", storage.uri, exc_info=True)
        self.storage = storage
        self.replaced = replaced_files(storage)
        self.token = uuid.uuid4().hex
        self.lease = Lease(storage, self.token, kind)

    def commit(self, staging: Storage, index_bytes: bytes) -> None:
        """Make the new checkpoint visible; on failure nothing half-done is left visible and
        nothing is deleted that ``collect`` would need to finish the commit."""
        try:
            self.lease.replacing(self.replaced)
            self.storage.commit(staging, INDEX_NAME, index_bytes, self.replaced)
        except BaseException:
            self.abort(staging)
            raise
        self.lease.release(remove=not self.storage.pending(self.token))

    def abort(self, staging: Storage) -> None:
        try:
            self.storage.abort(staging)
        finally:
            self.lease.release(remove=not self.storage.pending(self.token))


@dataclass
class GcReport:
    uri: str
    removed: list[str] = field(default_factory=list)
    rolled_forward: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def __bool__(self) -> bool:
        return bool(self.removed or self.rolled_forward or self.rolled_back)


def collect(
    target: str | Storage,
    *,
    owner: str | None = None,
    dry_run: bool = False,
    storage_options: Any = None,
) -> GcReport:
    """Remove what interrupted saves and converts into ``target`` left behind.

    Only runs whose lease is stale (see the module doc) or held by ``owner`` are touched.
    ``dry_run`` reports what would be done and changes nothing.
    """
    storage = target if isinstance(target, Storage) else open_storage(target, storage_options)
    report = GcReport(storage.uri)
    now = time.time()
    leases = storage.read_leases()
    current = replaced_files(storage)
    for token in sorted(set(leases) | set(storage.orphan_tokens())):
        raw = leases.get(token)
        record = LeaseRecord.loads(raw, token) if raw is not None else None
        if record is not None and not record.stale(now, owner):
            report.live.append(token)
            continue
        replaced = set(record.replaces) if record else None
        storage.collect_run(token, replaced, current, report, dry_run)
        if raw is not None:
            report.removed.append(storage.lease_path(token))
            if not dry_run:
                storage.remove_lease(token)
    if report:
        logger.info(
            "gc %s: removed %d, rolled forward %d, rolled back %d",
            storage.uri, len(report.removed), len(report.rolled_forward), len(report.rolled_back),
        )  # fmt: skip
    return report
