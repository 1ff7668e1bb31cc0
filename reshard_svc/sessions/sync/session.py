"""Live weight sync as a session: versioned pushes that send only what changed.

:func:`~reshard_svc.runtime.transfer.transfer` moves every byte on every call. An RL job
pushes its weights into inference engines every step, and between two steps about 99 % of
bf16 weights are bit-identical. A :class:`WeightSync`, built on every rank of the group,
keeps the plan, its buffers and what each sender last sent, and each push carries a
version:

1. ``begin(version)`` — every rank says which version its targets hold (per wave of the
   plan) and which version its record of what it sent is of: one small all-gather. From
   that table every rank decides the same thing for every piece: a **delta** when the
   receiver holds exactly the version the sender last sent it, else the **whole piece**
   (a restarted engine, a new replica, a missed or aborted push, a target written by
   someone else since, the first push, a new plan). Versions must go up.
2. ``update()`` — the plan runs on the one executor with a codec: for each piece the cost
   model (:mod:`reshard_svc.sessions.sync.costs`) weighs a delta's CPU against the bytes
   it saves on this link; a delta compares the piece with what the sender last sent, as
   integers (NaN payloads, ``-0.0`` and denormals are exact), and sends the changes in the
   smallest of raw, bitmask + values, runs + values and gaps + values
   (:mod:`reshard_svc.runtime.delta`); the sizes go ahead of the data. A box replicated on
   several receivers is relayed: sent once, forwarded among them as received. Receivers
   decode and check every payload before anything is written.
3. ``commit()`` — every rank agrees that every wave landed (and, for a push held until
   commit, was written), and only then do the records take the version: what each wave
   holds, what each sender last sent. When the plan is one wave (everything fits
   ``max_memory``) nothing is written before ``commit()``, so an engine can keep
   generating during ``update()`` and pause only for the swap; a plan of several waves
   writes each wave as it lands (:attr:`WeightSync.holds_until_commit`).

``push(version)`` is the three in one. **One version everywhere**: receivers write through
an undo journal (:class:`~reshard_svc.sessions.sync.journal.Journal`: what a push overwrote,
as it was), so a failure on any rank — an exception, a peer killed mid-wave, a write that
fails inside ``commit()`` — makes every surviving rank undo the push locally and raise
:class:`~reshard_svc.errors.TransferAbortedError`, its targets bitwise the last committed
version and its records unchanged (the next push is a delta again). A push that
overwrote more than ``undo_memory`` and then failed fences the rank instead
(:class:`~reshard_svc.errors.EngineFencedError`: ``version`` None, the next push refills
it whole). ``verify=True`` checks, before anything is written, the CRC32C of every landed
piece (patched, for a delta) against the sender's CRC32C of the same box.

Memory: each sender keeps one copy of every region it sends to another rank (its share
of the model when each byte goes to one receiver; :attr:`WeightSync.snapshot_bytes`),
made on the first push; ``delta=False`` keeps none and sends whole pieces every time.
Each receiver keeps what a push overwrites until commit, in host buffers reused push
after push (:attr:`WeightSync.undo_bytes`). Sources must not change between ``begin()``
and ``commit()``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from reshard_svc._collector import collector_paused
from reshard_svc.errors import (
    DistributedError,
    EngineFencedError,
    TransferAbortedError,
    UsageError,
)
from reshard_svc.plan.budget import Budget, parse_size
from reshard_svc.plan.cache import PlanCache
from reshard_svc.plan.transfer import Cat, TransferPlan
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.executor import execute
from reshard_svc.runtime.targets import Placed
from reshard_svc.runtime.transfer import (
    HeldSource,
    LocalSides,
    TransferEntry,
    agreed_plan,
    check_sources,
)
from reshard_svc.sessions.sync.codec import Codec
from reshard_svc.sessions.sync.costs import Costs
from reshard_svc.sessions.sync.journal import Journal, journal_pool
from reshard_svc.sessions.sync.landing import Landing
from reshard_svc.sessions.sync.records import Agreed, Geometry, Records

__all__ = ["SyncResult", "WeightSync"]


@dataclass(frozen=True, kw_only=True)
class SyncResult:
    """One push on this rank: the version, the target tensors written, the waves, the
    bytes this rank sent (encoded) against what a full push sends from it, the bytes it
    received, how many pieces it sent as deltas and whole, how it sent them
    (``encodings``: ``whole`` where no delta was possible, else the encoding the cost
    model chose: ``raw``, ``mask``, ``runs``, ``gaps``), and the wall time."""

    version: int
    updated: tuple[str, ...]
    waves: int
    bytes_sent: int
    bytes_full: int
    bytes_received: int
    delta_pieces: int
    whole_pieces: int
    plan_cached: bool
    held_until_commit: bool
    seconds: float
    encodings: Mapping[str, int] = field(default_factory=dict)


@dataclass(kw_only=True)
class Push:
    """One push in flight on this rank (its version is what every rank agreed to)."""

    local: LocalSides
    entry: TransferEntry
    cached: bool
    agreed: Agreed
    costs: Costs | None  # every rank's, agreed: the same choices everywhere
    start: float
    landing: Landing | None = None
    codec: Codec | None = None
    moved: bool = False

    @property
    def version(self) -> int:
        return self.agreed.version


class WeightSync:
    """A weight sync session from ``src`` to ``dst`` over ``process_group`` (every rank of
    it builds one, with the same ``names`` and ``max_memory``; see the module doc).

    ``src``/``dst`` are what :func:`~reshard_svc.runtime.transfer.transfer` takes (a rank
    passes ``None`` for a side it does not hold). Building a session communicates
    nothing; the first ``begin()`` plans. ``delta`` sends only changed elements from the
    second push on (keeping a copy of what each rank sent); ``verify`` checks every
    landed piece's CRC32C against its sender's before it is written. ``undo_memory``
    (default 1 GiB) bounds the host memory a receiving rank keeps of what a push
    overwrote, to undo it if the push fails; a failure after a push outgrew it fences
    the rank (:class:`~reshard_svc.errors.EngineFencedError`).
    """

    def __init__(
        self,
        src: Mapping[str, Any] | None,
        dst: Mapping[str, Any] | None,
        *,
        names: Mapping[str, str | Cat] | None = None,
        process_group: Any = None,
        max_memory: int | str | None = None,
        delta: bool = True,
        verify: bool = False,
        undo_memory: int | str = "1GiB",
    ) -> None:
        self._comm = Comm(process_group)
        self._undo_memory = parse_size(undo_memory, "undo_memory") or 0
        self._src, self._dst = src, dst
        self._names, self._budget = names, Budget.of(max_memory, "transfer")
        self._delta, self._verify = bool(delta), bool(verify)
        self._cache: PlanCache[Any] = PlanCache(1)
        self._geometry: Geometry | None = None
        self._records = Records()
        self._marks: dict[str, tuple[tuple[int, int], ...]] = {}  # target -> as we left it
        self._committed: int | None = None
        self._push: Push | None = None
        self._costs: Costs | None = None  # calibrated at the first push with deltas
        self._pool = journal_pool()  # the undo journals' host buffers, reused push after push

    # ---- what a caller can ask

    @property
    def version(self) -> int | None:
        """The version this rank's targets hold (None before the first commit, after
        :meth:`invalidate`, when a failed push fenced them, or when its waves hold
        different versions)."""
        if self._geometry is None:
            return None
        held = self._records.held
        seen = {held.get(w) for w in range(len(self._geometry.plan.waves))}
        return next(iter(seen)) if len(seen) == 1 else None  # {None} included

    @property
    def committed(self) -> int | None:
        """The last version every rank committed."""
        return self._committed

    @property
    def snapshot_bytes(self) -> int:
        """Bytes this rank keeps of what it last sent (the cost of delta mode)."""
        return sum(t.numel() * t.element_size() for t in self._records.snapshots.values())

    @property
    def undo_bytes(self) -> int:
        """Host bytes this rank keeps for undoing a push (its journal's buffers, at their
        high-water mark, at most ``undo_memory`` plus one 64 MiB chunk)."""
        return self._pool.nbytes

    @property
    def holds_until_commit(self) -> bool | None:
        """Whether ``update()`` writes nothing into the targets (the plan is one wave);
        None before the first ``begin()``."""
        entry = self._push.entry if self._push else None
        if entry is None:
            hit = self._cache.values()
            entry = hit[0] if hit else None
        return None if entry is None else len(entry.plan.waves) <= 1

    def invalidate(self) -> None:
        """This rank's targets no longer hold what the session last wrote (an engine
        reloaded its weights): its next push receives whole pieces. Local, not collective.
        A target written in place by anyone else is noticed without this."""
        self._records.held.clear()
        self._marks.clear()

    # ---- the phases

    def push(
        self,
        version: int,
        *,
        src: Mapping[str, Any] | None = None,
        dst: Mapping[str, Any] | None = None,
    ) -> SyncResult:
        """``begin(version)``, ``update()`` and ``commit()``, on every rank."""
        self.begin(version, src=src, dst=dst)
        self.update()
        return self.commit()

    def begin(
        self,
        version: int,
        *,
        src: Mapping[str, Any] | None = None,
        dst: Mapping[str, Any] | None = None,
    ) -> None:
        """Start pushing ``version`` (collective). ``src``/``dst``, when given, replace the
        session's state dicts from now on (a re-wrapped trainer, a rebuilt engine; a new
        layout on any rank re-plans everywhere and pushes whole pieces)."""
        if self._push is not None:
            raise UsageError("begin() again before commit() or abort() of the push in flight")
        if src is not None:
            self._src = src
        if dst is not None:
            self._dst = dst
        start = time.perf_counter()
        comm = self._comm
        with torch.no_grad(), collector_paused():
            local = LocalSides.of(self._src, self._dst, self._names, self._budget, comm)
            entry, cached = agreed_plan(local, comm, self._names, self._budget, self._cache)
            if self._geometry is None or self._geometry.plan is not entry.plan:
                self._new_plan(entry)
            self._notice_foreign_writes(local)
            waves = len(entry.plan.waves)
            if self._delta and self._costs is None:  # every rank at once: a shared machine
                self._costs = Costs.calibrate()  # is measured as shared
            mine = self._costs

            def agree() -> dict[str, Any]:  # a bad version fails every rank, not just its own
                if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                    raise UsageError(f"a push's version is an int >= 0, got {version!r}")
                return {
                    "version": version,
                    "committed": self._committed,
                    "held": [self._records.held.get(w) for w in range(waves)],
                    "sent": [
                        self._records.sent.get(w) if self._delta else None for w in range(waves)
                    ],
                    "costs": None if mine is None else mine.figures(),
                }

            _, table = comm.run_everywhere("sync: agreeing on the version", agree)
            agreed = Agreed.of(version, table)  # or every rank raises the same error
            if self._verify:
                check_sources(entry, local, comm)
        self._push = Push(
            local=local,
            entry=entry,
            cached=cached,
            agreed=agreed,
            costs=Costs.agreed([t["costs"] for t in table if t["costs"] is not None]),
            start=start,
        )

    def update(self) -> None:
        """Move the data of the push begun (collective); see the module doc for when it
        writes into the targets. On a failure every rank raises
        :class:`~reshard_svc.errors.TransferAbortedError` and the push is over."""
        push = self._require("update", moved=False)
        plan = push.entry.plan
        landing, codec = self._destination(push)
        push.landing, push.codec = landing, codec
        comm = self._comm
        moving = time.perf_counter()
        try:
            with torch.no_grad(), collector_paused():
                execute(
                    plan,
                    HeldSource(push.local.src, push.entry.dtypes),
                    comm,
                    landing,
                    arena=push.entry.arena,
                    verify=self._verify,
                    label="sync ",
                    codec=codec,
                )
        except Exception as e:
            self._fail(push, landing, e)
        if codec is not None and self._costs is not None:
            self._costs.measured(
                sent=codec.bytes_sent,
                raw=codec.bytes_raw,
                seconds=time.perf_counter() - moving,
                compared=codec.bytes_compared,
                changes=codec.priced_changes,
            )
        push.moved = True

    def commit(self) -> SyncResult:
        """Write what ``update()`` held back and record the version (collective)."""
        push = self._require("commit", moved=True)
        landing, codec = push.landing, push.codec
        if landing is None:  # pragma: no cover (update() set it)
            raise UsageError("commit() before update()")

        def write() -> None:  # held waves, journaled; then every rank says it wrote
            with torch.no_grad():
                landing.write_parked()

        try:
            self._comm.run_everywhere("sync: committing", write)
        except Exception as e:
            self._fail(push, landing, e)
        # every rank has written every wave: the version becomes the records'
        self._push = None
        landing.record(push.version)
        if codec is not None:
            codec.record()
        self._remember(landing.touched, push.local.dst)
        self._committed = push.version
        rank, plan = self._comm.rank, push.entry.plan
        sent = codec.bytes_sent if codec else plan.sent[rank]
        received = codec.bytes_received if codec else plan.received[rank]
        return SyncResult(
            version=push.version,
            updated=tuple(landing.updated),
            waves=len(plan.waves),
            bytes_sent=sent,
            bytes_full=plan.sent[rank],
            bytes_received=received,
            delta_pieces=codec.deltas if codec else 0,
            whole_pieces=codec.wholes if codec else _pieces_sent(plan, rank, self._geometry),
            plan_cached=push.cached,
            held_until_commit=landing.hold,
            seconds=time.perf_counter() - push.start,
            encodings=dict(codec.encodings) if codec else {},
        )

    def abort(self) -> None:
        """Drop the push in flight after ``begin()`` or ``update()`` (every rank calls it
        instead of ``commit()``; local): what it wrote is undone, every version stays.
        Raises :class:`~reshard_svc.errors.EngineFencedError` when it cannot be undone."""
        push, self._push = self._push, None
        if push is None or push.landing is None:
            return
        if not self._undo(push, push.landing):
            raise EngineFencedError(
                f"push of version {push.version} aborted, but what it wrote on this rank "
                f"could not be undone ({_outgrew(self._undo_memory)}): this rank's engine "
                "must be refilled; the next push sends it whole pieces",
                updated=(),
                untouched=(),
            )

    def _undo(self, push: Push, landing: Landing) -> bool:
        """Put back what ``push`` wrote on this rank; False: it could not (fenced)."""
        with torch.no_grad():
            whole = landing.undo()
        self._remember(landing.touched, push.local.dst)
        return whole

    def _fail(self, push: Push, landing: Landing, e: Exception) -> NoReturn:
        """A push failed on some rank: undo it here and raise (fenced if it cannot be)."""
        self._push = None
        whole = self._undo(push, landing)
        plan, comm = push.entry.plan, self._comm
        failures = e.failures if isinstance(e, DistributedError) else {comm.rank: str(e)}
        if whole:
            raise TransferAbortedError(
                f"{e}. Push of version {push.version} undone: every target on this rank "
                f"holds what it held before (version {self.version})",
                failures,
                updated=(),
                untouched=tuple(plan.tensors),
            ) from e
        raise EngineFencedError(
            f"{e}. Push of version {push.version} failed and could not be undone on rank "
            f"{comm.rank} ({_outgrew(self._undo_memory)}): this rank's engine holds a mix "
            "and must be refilled; sync.version is None and the next push sends it whole "
            "pieces",
            failures,
            updated=(),
            untouched=(),
        ) from e

    # ---- bookkeeping

    def _destination(self, push: Push) -> tuple[Landing, Codec | None]:
        """Where a push lands on this rank, and how its pieces are encoded (deltas on)."""
        geometry = self._geometry
        if geometry is None:  # pragma: no cover (begin() set it)
            raise UsageError("update() before begin()")
        hold = len(push.entry.plan.waves) <= 1
        landing = Landing(
            push.entry.plan,
            push.local.dst,
            push.entry.arena,
            hold=hold,
            records=self._records,
            geometry=geometry,
            journal=Journal(self._undo_memory, self._pool),
        )
        if not self._delta or push.costs is None:
            return landing, None
        codec = Codec(
            records=self._records,
            agreed=push.agreed,
            geometry=geometry,
            landing=landing,
            dtypes=push.entry.dtypes,
            verify=self._verify,
            costs=push.costs,
        )
        return landing, codec

    def _require(self, what: str, *, moved: bool) -> Push:
        push = self._push
        if push is None:
            raise UsageError(f"{what}() with no push begun: call begin(version) first")
        if push.moved != moved:
            raise UsageError(
                f"{what}() " + ("before update()" if moved else "after update(): call commit()")
            )
        return push

    def _new_plan(self, entry: TransferEntry) -> None:
        """A plan the session has not run. The same plan made again (every rank re-plans
        when one rank's session is new) keeps what the session recorded; any other plan
        starts from nothing."""
        same = self._geometry is not None and self._geometry.plan_id == entry.plan_id
        self._geometry = Geometry.of(entry)
        if not same:
            self._records.clear()
            self._marks.clear()

    def _notice_foreign_writes(self, local: LocalSides) -> None:
        if self._geometry is None:
            return
        for name, placed in local.dst.items():
            if self._marks.get(name) != _mark(placed):
                wave = self._geometry.wave_of_name.get(name)
                if wave is not None:
                    self._records.held.pop(wave, None)

    def _remember(self, names: list[str], dst: Mapping[str, Placed]) -> None:
        """How the targets written by a push are left, once the push wrote all it will
        (targets can share memory, as a fused engine buffer's views do, so one written
        late moves the counter of one written early)."""
        for name in names:
            if name in dst:
                self._marks[name] = _mark(dst[name])


def _outgrew(budget: int) -> str:
    return f"what it overwrote outgrew undo_memory={budget} bytes, or could not be written back"


def _mark(placed: Placed) -> tuple[tuple[int, int], ...]:
    """Where a target's memory is and how often it has been written (torch counts every
    in-place write of a tensor and its views)."""
    return tuple((t.data_ptr(), t._version) for _, t in sorted(placed.local.items()))


def _pieces_sent(plan: TransferPlan, rank: int, geometry: Geometry | None) -> int:
    if geometry is None:
        return 0
    return sum(
        1 for w in plan.waves for p in w.pieces if geometry.reads[p.read].reader == rank != p.dest
    )
