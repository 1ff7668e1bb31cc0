"""Jobs in SQLite (WAL). Every write commits before the API replies.

One server per database: :class:`ServerLock` is an exclusive ``flock`` on ``<db>.lock``
taken before any job is read; it names its holder (pid, address), so a second server can
say which one to stop. The lock dies with its process (a crash frees it).
"""

from __future__ import annotations

import builtins
import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "AuditRow",
    "DatabaseInUse",
    "JobRow",
    "JobStore",
    "QueueFull",
    "ServerLock",
    "WatchExists",
    "WatchRow",
    "WatchStepRow",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    idem_key TEXT UNIQUE,
    idem_hash TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    progress TEXT NOT NULL DEFAULT '{}',
    error TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE TABLE IF NOT EXISTS watches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_scan_at REAL,
    stopped_at REAL,
    error TEXT
);
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    principal TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    outcome TEXT NOT NULL,
    code INTEGER NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '',
    address TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS watch_steps (
    watch_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    source TEXT NOT NULL,
    outcome TEXT NOT NULL,
    job_id TEXT,
    detail TEXT,
    at REAL NOT NULL,
    PRIMARY KEY (watch_id, step)
);
"""
#: Columns added after the first release, with their types (added on open when missing).
COLUMNS = {
    "engine": "TEXT",  # which launcher ran the job
    "handle": "TEXT",  # the engine's JSON handle (PID, Slurm job id, TrainJob name)
    "token_hash": "TEXT",  # sha256 of the job's callback token
    "final": "TEXT",  # the workers' done/error event, as JSON
    "reason": "TEXT",  # why the engine keeps the job waiting (its own words)
    "pending_since": "REAL",  # when the engine started keeping it waiting
    "owner": "TEXT NOT NULL DEFAULT ''",  # the principal that submitted it
}


class DatabaseInUse(Exception):
    """Another server holds the job database; ``holder`` says which (pid, address)."""

    def __init__(self, db: str, holder: dict[str, Any]) -> None:
        self.db, self.holder = db, holder
        where = holder.get("address") or "an address not yet bound"
        since = holder.get("since")
        when = time.strftime(" since %H:%M:%S", time.localtime(since)) if since else ""
        super().__init__(
            f"the job database {db} is in use by another reshard-server (pid "
            f"{holder.get('pid', '?')}, {where}{when}). One server per database: stop that "
            "one, or give this one its own RESHARD_DB (and RESHARD_DATA_DIR)"
        )


class ServerLock:
    """An exclusive lock on a job database, held for the life of the server process."""

    def __init__(self, db: str) -> None:
        self.db = db
        self.path = f"{db}.lock"
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DatabaseInUse(db, holder) from None
        self.fd = fd
        self._say({"pid": os.getpid(), "since": time.time()})

    def bound(self, address: str) -> None:
        """Record the address this server listens on (for a second server's message)."""
        self._say({"pid": os.getpid(), "since": time.time(), "address": address})

    def _say(self, holder: dict[str, Any]) -> None:
        data = json.dumps(holder).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class QueueFull(Exception):
    """The queue holds ``max_queued`` jobs already."""


@dataclass(kw_only=True)
class JobRow:
    id: str
    state: str
    spec: dict[str, Any]
    idem_key: str | None
    idem_hash: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    progress: dict[str, Any]
    error: str | None
    attempts: int
    cancel_requested: bool
    engine: str | None = None
    handle: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    reason: str | None = None
    pending_since: float | None = None
    owner: str = ""

    @property
    def at_engine(self) -> bool:
        """Submitted to the engine and not concluded (running, or waiting there)."""
        return self.handle is not None and self.state in ("queued", "running")

    @classmethod
    def from_row(cls, r: sqlite3.Row) -> JobRow:
        return cls(
            id=r["id"],
            state=r["state"],
            spec=json.loads(r["spec"]),
            idem_key=r["idem_key"],
            idem_hash=r["idem_hash"],
            created_at=r["created_at"],
            started_at=r["started_at"],
            finished_at=r["finished_at"],
            progress=json.loads(r["progress"] or "{}"),
            error=r["error"],
            attempts=r["attempts"],
            cancel_requested=bool(r["cancel_requested"]),
            engine=r["engine"],
            handle=json.loads(r["handle"]) if r["handle"] else None,
            final=json.loads(r["final"]) if r["final"] else None,
            reason=r["reason"],
            pending_since=r["pending_since"],
            owner=r["owner"] or "",
        )


@dataclass(kw_only=True)
class AuditRow:
    seq: int
    at: float
    principal: str
    action: str
    target: str
    outcome: str
    code: int
    detail: str
    address: str


class WatchExists(Exception):
    """An active watch already converts this root to this target: ``watch_id``."""

    def __init__(self, watch_id: str) -> None:
        self.watch_id = watch_id
        super().__init__(watch_id)


@dataclass(kw_only=True)
class WatchStepRow:
    step: int
    source: str
    outcome: str
    job_id: str | None
    detail: str | None
    at: float


@dataclass(kw_only=True)
class WatchRow:
    id: str
    state: str
    spec: dict[str, Any]
    created_at: float
    last_scan_at: float | None
    stopped_at: float | None
    error: str | None
    owner: str = ""

    @classmethod
    def from_row(cls, r: sqlite3.Row) -> WatchRow:
        return cls(
            id=r["id"],
            state=r["state"],
            spec=json.loads(r["spec"]),
            created_at=r["created_at"],
            last_scan_at=r["last_scan_at"],
            stopped_at=r["stopped_at"],
            error=r["error"],
            owner=r["owner"] or "",
        )


def _where(*conds: tuple[str, Any]) -> tuple[str, list[Any]]:
    """A WHERE clause of the ``(condition, value)`` pairs whose value is not None."""
    kept = [(c, v) for c, v in conds if v is not None]
    if not kept:
        return "", []
    return "WHERE " + " AND ".join(c for c, _ in kept), [v for _, v in kept]


class JobStore:
    """Thread-safe access to the jobs table (and the watches that submit jobs)."""

    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
        for name, kind in COLUMNS.items():
            if name not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
        have = {r[1] for r in self._db.execute("PRAGMA table_info(watches)")}
        if "owner" not in have:
            self._db.execute("ALTER TABLE watches ADD COLUMN owner TEXT NOT NULL DEFAULT ''")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create(
        self,
        spec: dict[str, Any],
        idem_key: str | None,
        idem_hash: str | None,
        max_queued: int,
        owner: str = "",
        owner_max_queued: int | None = None,
    ) -> tuple[JobRow, bool]:
        """Insert a queued job for ``owner``; with an idempotency key already used, return
        that job.

        Returns (job, created). Raises QueueFull when ``max_queued`` jobs are queued, or
        ``owner_max_queued`` of the owner's.
        """
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if idem_key is not None:
                    row = self._db.execute(
                        "SELECT * FROM jobs WHERE idem_key=?", (idem_key,)
                    ).fetchone()
                    if row is not None:
                        self._db.execute("COMMIT")
                        return JobRow.from_row(row), False
                (queued,) = self._db.execute(
                    "SELECT COUNT(*) FROM jobs WHERE state='queued'"
                ).fetchone()
                if queued >= max_queued:
                    raise QueueFull(f"{queued} jobs are queued (limit {max_queued})")
                if owner_max_queued is not None:
                    (mine,) = self._db.execute(
                        "SELECT COUNT(*) FROM jobs WHERE state='queued' AND owner=?", (owner,)
                    ).fetchone()
                    if mine >= owner_max_queued:
                        raise QueueFull(
                            f"user {owner!r} has {mine} queued jobs (their limit, max_queued, "
                            f"is {owner_max_queued})"
                        )
                job_id = uuid.uuid4().hex[:16]
                self._db.execute(
                    "INSERT INTO jobs (id, state, spec, idem_key, idem_hash, created_at, owner) "
                    "VALUES (?, 'queued', ?, ?, ?, ?, ?)",
                    (job_id, json.dumps(spec), idem_key, idem_hash, time.time(), owner),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            row = self._db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
            return JobRow.from_row(row), True

    def get(self, job_id: str) -> JobRow | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return JobRow.from_row(row) if row else None

    def list(
        self, state: str | None, limit: int, offset: int, owner: str | None = None
    ) -> tuple[builtins.list[JobRow], int]:
        """Jobs newest first, in ``state`` and of ``owner`` when given; and how many."""
        where, args = _where(("state=?", state or None), ("owner=?", owner))
        with self._lock:
            (total,) = self._db.execute(f"SELECT COUNT(*) FROM jobs {where}", args).fetchone()
            rows = self._db.execute(
                f"SELECT * FROM jobs {where} ORDER BY seq DESC LIMIT ? OFFSET ?",
                (*args, limit, offset),
            ).fetchall()
        return [JobRow.from_row(r) for r in rows], total

    def in_state(self, *states: str) -> builtins.list[JobRow]:
        marks = ",".join("?" * len(states))
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY seq", states
            ).fetchall()
        return [JobRow.from_row(r) for r in rows]

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {r[0]: r[1] for r in rows}

    def audit(
        self,
        principal: str,
        action: str,
        target: str,
        outcome: str,
        code: int = 0,
        detail: str = "",
        address: str = "",
    ) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO audit (at, principal, action, target, outcome, code, detail, "
                "address) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    time.time(),
                    principal,
                    action,
                    target[:1000],
                    outcome,
                    code,
                    detail[:2000],
                    address,
                ),
            )

    def audit_log(
        self, limit: int, before: int | None = None, principal: str | None = None
    ) -> builtins.list[AuditRow]:
        """Audit lines newest first (``before``: a seq, for paging)."""
        where, args = _where(("seq<?", before), ("principal=?", principal))
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM audit {where} ORDER BY seq DESC LIMIT ?", (*args, limit)
            ).fetchall()
        return [AuditRow(**{k: r[k] for k in r.keys()}) for r in rows]

    def by_token_hash(self, token_hash: str) -> str | None:
        """The id of the job whose callback token hashes to ``token_hash``."""
        with self._lock:
            row = self._db.execute(
                "SELECT id FROM jobs WHERE token_hash=?", (token_hash,)
            ).fetchone()
        return row[0] if row else None

    def update(self, job_id: str, **fields: Any) -> None:
        for key in ("progress", "handle", "final"):
            if key in fields and fields[key] is not None:
                fields[key] = json.dumps(fields[key])
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {cols} WHERE id=?", (*fields.values(), job_id))

    def transition(self, job_id: str, from_states: tuple[str, ...], **fields: Any) -> bool:
        """Update only if the job is in one of ``from_states``; True when it was."""
        for key in ("progress", "handle", "final"):
            if key in fields and fields[key] is not None:
                fields[key] = json.dumps(fields[key])
        cols = ", ".join(f"{k}=?" for k in fields)
        marks = ",".join("?" * len(from_states))
        with self._lock:
            cur = self._db.execute(
                f"UPDATE jobs SET {cols} WHERE id=? AND state IN ({marks})",
                (*fields.values(), job_id, *from_states),
            )
            return cur.rowcount > 0

    # ---- watches: a root whose newly committed steps become jobs

    def create_watch(
        self, spec: dict[str, Any], baseline: dict[int, str], owner: str = ""
    ) -> WatchRow:
        """Insert an active watch and the steps it will not convert (``baseline``: step ->
        source), in one transaction. Raises WatchExists when an active watch has the same
        root and target."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for row in self._db.execute("SELECT id, spec FROM watches WHERE state='active'"):
                    other = json.loads(row["spec"])
                    if (other["root"], other["target"]) == (spec["root"], spec["target"]):
                        raise WatchExists(row["id"])
                watch_id = uuid.uuid4().hex[:16]
                now = time.time()
                self._db.execute(
                    "INSERT INTO watches (id, state, spec, created_at, owner) "
                    "VALUES (?, 'active', ?, ?, ?)",
                    (watch_id, json.dumps(spec), now, owner),
                )
                self._db.executemany(
                    "INSERT INTO watch_steps (watch_id, step, source, outcome, at) "
                    "VALUES (?, ?, ?, 'existing', ?)",
                    [(watch_id, step, source, now) for step, source in baseline.items()],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            row = self._db.execute("SELECT * FROM watches WHERE id=?", (watch_id,)).fetchone()
        return WatchRow.from_row(row)

    def get_watch(self, watch_id: str) -> WatchRow | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM watches WHERE id=?", (watch_id,)).fetchone()
        return WatchRow.from_row(row) if row else None

    def watches(self, *states: str) -> builtins.list[WatchRow]:
        """Watches in ``states`` (all when none are named), oldest first."""
        where = f"WHERE state IN ({','.join('?' * len(states))})" if states else ""
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM watches {where} ORDER BY seq", states)
            return [WatchRow.from_row(r) for r in rows.fetchall()]

    def update_watch(self, watch_id: str, **fields: Any) -> None:
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE watches SET {cols} WHERE id=?", (*fields.values(), watch_id))

    def stop_watch(self, watch_id: str) -> bool:
        """Stop an active watch; False when it was not active."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE watches SET state='stopped', stopped_at=? WHERE id=? AND state='active'",
                (time.time(), watch_id),
            )
            return cur.rowcount > 0

    def watch_steps(self, watch_id: str, limit: int | None = None) -> builtins.list[WatchStepRow]:
        """The steps a watch has dealt with, newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM watch_steps WHERE watch_id=? ORDER BY step DESC LIMIT ?",
                (watch_id, -1 if limit is None else limit),
            ).fetchall()
        return [
            WatchStepRow(
                step=r["step"],
                source=r["source"],
                outcome=r["outcome"],
                job_id=r["job_id"],
                detail=r["detail"],
                at=r["at"],
            )
            for r in rows
        ]

    def count_submitted(self, watch_id: str) -> int:
        with self._lock:
            (n,) = self._db.execute(
                "SELECT COUNT(*) FROM watch_steps WHERE watch_id=? AND outcome='submitted'",
                (watch_id,),
            ).fetchone()
        return int(n)

    def record_step(
        self,
        watch_id: str,
        step: int,
        source: str,
        outcome: str,
        job_id: str | None = None,
        detail: str | None = None,
    ) -> None:
        """What a watch did with ``step`` (once: a step already recorded keeps its record)."""
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO watch_steps (watch_id, step, source, outcome, job_id, "
                "detail, at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (watch_id, step, source, outcome, job_id, detail, time.time()),
            )
