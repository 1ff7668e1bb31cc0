"""One owner per target: the lease a save or convert holds from before its first data file
is written until after its commit or abort.

The lease is one small JSON record beside the target (:class:`LeaseRecord`: token, owner,
host, pid and the process's start time, when it started, what its commit replaces),
created atomically through the target's :class:`~reshard_svc.storage.base.LeaseStore` —
an exclusive create on local and shared filesystems, ``If-None-Match: *`` on S3. A second
run aimed at a held target fails at once with
:class:`~reshard_svc.errors.TargetBusyError` naming the holder. A heartbeat renews the
lease; a run that finds it replaced stops renewing and never commits (``confirm`` is
called right before every commit).

A lease is *stale* when no heartbeat renewed it for its TTL, when its process on this host
is gone (a zombie counts as gone, and so does another process that reuses the pid), or
when the caller names its owner (the server, once it knows a job's workers are gone). A
stale lease is taken over by compare-and-swap, so only one contender wins; the contender
first has the stale run's leftovers collected (``on_stale``), while the lease still names
that run as the owner of record.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from reshard_svc._process import alive, process_start
from reshard_svc.errors import StorageError, TargetBusyError
from reshard_svc.storage.base import LeaseHeld, LeaseLost, LeaseState, LeaseStore

__all__ = [
    "LEASE_TTL_S",
    "Lease",
    "LeaseRecord",
    "default_owner",
    "set_owner",
]

logger = logging.getLogger(__name__)

#: A lease whose heartbeat is older than this is stale (seconds).
LEASE_TTL_S = float(os.environ.get("RESHARD_LEASE_TTL_S", "120"))
#: How often the holder renews its lease (seconds).
HEARTBEAT_S = max(1.0, LEASE_TTL_S / 6)
#: How many times a contender retries after losing a takeover race before it gives up.
TAKEOVER_TRIES = 3


_owner = ""


def set_owner(name: str) -> None:
    """Name the owner of the leases this process takes from now on (a server's worker:
    ``reshard-job-<id>``, which the server can then declare over)."""
    global _owner
    _owner = name


def default_owner() -> str:
    """The owner of record of the leases this process takes ("" unless set)."""
    return _owner


@dataclass(kw_only=True)
class LeaseRecord:
    """What a lease says about its holder."""

    token: str
    kind: str
    owner: str
    host: str
    pid: int
    started: float
    ttl: float = LEASE_TTL_S
    #: the holder's own clock at its last write (for stores that cannot date a write)
    renewed: float = 0.0
    #: the start time of ``pid`` (see :func:`process_start`); 0 when unknown
    pid_start: int = 0
    #: files of the checkpoint this run replaces (set just before its commit)
    replaces: list[str] = field(default_factory=list)

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def loads(cls, raw: bytes) -> LeaseRecord | None:
        """The record, or None when it is unreadable (a torn write: treated as stale)."""
        try:
            data = json.loads(raw)
            return cls(
                token=str(data["token"]),
                kind=str(data["kind"]),
                owner=str(data.get("owner", "")),
                host=str(data["host"]),
                pid=int(data["pid"]),
                started=float(data["started"]),
                ttl=float(data.get("ttl", LEASE_TTL_S)),
                renewed=float(data.get("renewed", data.get("started", 0))),
                pid_start=int(data.get("pid_start", 0)),
                replaces=[str(n) for n in data.get("replaces", [])],
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def expires(self, modified: float | None) -> float:
        return (modified if modified is not None else self.renewed) + self.ttl

    def stale(self, now: float, modified: float | None, owner: str | None = None) -> bool:
        if owner and self.owner == owner:
            return True
        if self.expires(modified) < now:
            return True
        return self.host == socket.gethostname() and not alive(self.pid, self.pid_start)

    def describe(self, now: float) -> str:
        """The holder, for a person: who, where, for how long."""
        who = self.owner or f"pid {self.pid} on {self.host}"
        if self.owner:
            who += f" (pid {self.pid} on {self.host})"
        return f"a {self.kind} by {who}, started {now - self.started:.0f} s ago"


def parse(state: LeaseState | None) -> LeaseRecord | None:
    return LeaseRecord.loads(state.record) if state is not None else None


class Lease:
    """Held by a save's or convert's coordinator from before its first write until its
    commit or abort; renewed every :data:`HEARTBEAT_S` by a daemon thread."""

    def __init__(self, store: LeaseStore, uri: str, record: LeaseRecord, version: str) -> None:
        self.store, self.uri, self.record, self.version = store, uri, record, version
        self.lost = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name="reshard-lease", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(
        cls,
        store: LeaseStore,
        uri: str,
        token: str,
        kind: str,
        on_stale: Callable[[LeaseRecord | None, LeaseState], None],
    ) -> Lease:
        """Take the target's lease, or raise :class:`TargetBusyError` naming its holder.

        A stale lease is taken over: ``on_stale(record, state)`` collects what its run left
        (it is still the owner of record), then the lease is replaced only if it is still
        that one; of several contenders exactly one wins."""
        now = time.time()
        pid = os.getpid()
        record = LeaseRecord(
            token=token,
            kind=kind,
            owner=default_owner(),
            host=socket.gethostname(),
            pid=pid,
            started=now,
            renewed=now,
            pid_start=process_start(pid),
        )
        for _ in range(TAKEOVER_TRIES):
            try:
                return cls(store, uri, record, store.create_lease(record.dumps(), token))
            except LeaseHeld as held:
                state = held.state
            if not state.version:
                continue  # released and taken again while we looked: nothing to take over
            holder = parse(state)
            now = time.time()
            if holder is not None and not holder.stale(now, state.modified):
                raise _busy(uri, store, holder, state, now)
            on_stale(holder, state)
            record.renewed = time.time()
            try:
                version = store.replace_lease(state.version, record.dumps(), token)
            except LeaseLost:
                continue  # another contender took it first: look again
            logger.info("took over a stale lease on %s", uri)
            return cls(store, uri, record, version)
        current = store.read_lease()
        holder = parse(current)
        if holder is not None and current is not None:
            raise _busy(uri, store, holder, current, time.time())
        raise TargetBusyError(
            f"{uri}: could not take its lease ({store.lease_path()}): other "
            "runs keep taking it; retry when they are done"
        )

    def _write(self) -> None:
        with self._lock:
            if self.lost:
                raise LeaseLost
            self.record.renewed = time.time()
            try:
                self.version = self.store.renew_lease(self.version, self.record.dumps())
            except LeaseLost:
                self.lost = True
                raise

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except LeaseLost:
                logger.error(
                    "lost the lease on %s to another run: this run will not commit", self.uri
                )
                return
            except Exception:  # a missed heartbeat only shortens the lease
                logger.warning("could not renew the lease on %s", self.uri, exc_info=True)

    def confirm(self) -> None:
        """Renew now; raise :class:`TargetBusyError` if another run holds the lease (this
        run must not commit)."""
        try:
            self._write()
        except LeaseLost:
            holder = parse(self.store.read_lease())
            who = holder.describe(time.time()) if holder else "another run"
            raise TargetBusyError(
                f"{self.uri}: this run lost its lease (not renewed for "
                f"{self.record.ttl:.0f} s) and {who} took the target over; nothing was "
                "committed"
            ) from None

    def replacing(self, files: set[str]) -> None:
        """Record what the commit will replace, so a crash mid-commit can be finished."""
        self.record.replaces = sorted(files)
        self.confirm()

    def release(self, remove: bool = True) -> None:
        """Stop renewing; ``remove=False`` leaves the record (stale once this process is
        gone), so that a later collection finishes what this run could not."""
        self._stop.set()
        self._thread.join(timeout=5)
        if not remove or self.lost:
            return
        try:
            self.store.drop_lease(self.version)
        except (StorageError, LeaseLost):  # it goes stale on its own
            logger.warning("could not remove the lease on %s", self.uri, exc_info=True)


def _busy(
    uri: str, store: LeaseStore, holder: LeaseRecord, state: LeaseState, now: float
) -> TargetBusyError:
    left = max(0.0, holder.expires(state.modified) - now)
    return TargetBusyError(
        f"{uri} is being written by {holder.describe(now)} (its lease: "
        f"{store.lease_path()}). Wait for it to finish, or pick another target; if that run "
        f"is dead, its lease goes stale within {left:.0f} s and the next run (or `reshard gc "
        f"{uri}`) collects what it left",
        holder=holder.owner or f"pid {holder.pid} on {holder.host}",
        age=now - holder.started,
    )
