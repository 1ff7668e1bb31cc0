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
2. ``update()`` — the plan runs on the one executor with a codec: the sender compares each
   piece with what it last sent, as integers (NaN payloads, ``-0.0`` and denormals are
   exact), and sends the changes in the smallest of raw, bitmask + values, runs + values
   and gaps + values (:mod:`reshard_svc.runtime.delta`); the sizes go ahead of the data.
   Receivers decode and check every payload before anything is written.
3. ``commit()`` — the landed pieces are written into the targets (whole pieces copied,
   deltas patched in place), each sender updates its record, and every rank records the
   version. When the plan is one wave (everything fits ``max_memory``) nothing is
   written before ``commit()``, so an engine can keep generating during ``update()`` and
   pause only for the swap; a plan of several waves writes each wave as it lands, whole
   on every rank, as ``transfer`` does (:attr:`WeightSync.holds_until_commit`).

``push(version)`` is the three in one. All or nothing per wave, as in ``transfer``: a
failure on any rank makes every rank raise
:class:`~reshard_svc.errors.TransferAbortedError`, no target is half-written, and every
rank keeps the versions it had, so the next push is correct (whole pieces where a
receiver fell behind). ``verify=True`` checks, before anything is written, the CRC32C of
every landed piece (patched, for a delta) against the sender's CRC32C of the same box.

Memory: each sender keeps one copy of every region it sends to another rank (its share
of the model when each byte goes to one receiver; :attr:`WeightSync.snapshot_bytes`),
made on the first push; ``delta=False`` keeps none and sends whole pieces every time.
Sources must not change between ``begin()`` and ``commit()``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard_svc._collector import collector_paused
from reshard_svc.errors import DistributedError, TransferAbortedError, TransferError, UsageError
from reshard_svc.layout import Box
from reshard_svc.plan.cache import PlanCache
from reshard_svc.plan.items import Piece, Read, Wave
from reshard_svc.plan.transfer import Cat, TransferPlan
from reshard_svc.runtime import delta
from reshard_svc.runtime.buffers import Arena
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.executor import execute
from reshard_svc.runtime.targets import Placed
from reshard_svc.runtime.transfer import (
    DEFAULT_MAX_MEMORY,
    _check_sources,
    _Entry,
    _HeldSource,
    _Local,
    _plan,
    _Staging,
)

__all__ = ["SyncResult", "WeightSync"]

_Key = tuple[int, Box]  # a region a sender sends: (read id, box)


@dataclass(frozen=True, kw_only=True)
class SyncResult:
    """One push on this rank: the version, the target tensors written, the waves, the
    bytes this rank sent (encoded) against what a full push sends from it, the bytes it
    received, how many pieces it sent as deltas and whole, and the wall time."""

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


@dataclass(kw_only=True)
class _Geometry:
    """What the session derives from a plan once: each target's and read's wave, and the
    reads by id."""

    plan_id: int
    plan: TransferPlan
    wave_of_target: dict[int, int]
    wave_of_name: dict[str, int]
    wave_index: dict[int, int]  # id(wave) -> index
    reads: dict[int, Read]

    @classmethod
    def of(cls, entry: _Entry) -> _Geometry:
        plan = entry.plan
        of_target, of_name, index, reads = {}, {}, {}, {}
        for wi, wave in enumerate(plan.waves):
            index[id(wave)] = wi
            for name in wave.tensors:
                of_name[name] = wi
            for r in wave.reads:
                reads[r.id] = r
            for p in wave.pieces:
                of_target[p.target] = wi
        return cls(
            plan_id=entry.plan_id,
            plan=plan,
            wave_of_target=of_target,
            wave_of_name=of_name,
            wave_index=index,
            reads=reads,
        )


@dataclass(kw_only=True)
class _Push:
    """One push in flight on this rank."""

    version: int
    local: _Local
    entry: _Entry
    cached: bool
    #: [rank][wave] -> the version that rank's targets hold / its record of what it sent
    held: list[list[int | None]]
    sent: list[list[int | None]]
    start: float
    landing: _Landing | None = None
    codec: _Codec | None = None
    moved: bool = False


class WeightSync:
    """A weight sync session from ``src`` to ``dst`` over ``process_group`` (every rank of
    it builds one, with the same ``names`` and ``max_memory``; see the module doc).

    ``src``/``dst`` are what :func:`~reshard_svc.runtime.transfer.transfer` takes (a rank
    passes ``None`` for a side it does not hold). Building a session communicates
    nothing; the first ``begin()`` plans. ``delta`` sends only changed elements from the
    second push on (keeping a copy of what each rank sent); ``verify`` checks every
    landed piece's CRC32C against its sender's before it is written.
    """

    def __init__(
        self,
        src: Mapping[str, Any] | None,
        dst: Mapping[str, Any] | None,
        *,
        names: Mapping[str, str | Cat] | None = None,
        process_group: Any = None,
        max_memory: int = DEFAULT_MAX_MEMORY,
        delta: bool = True,
        verify: bool = False,
    ) -> None:
        if not isinstance(max_memory, int) or max_memory <= 0:
            raise UsageError(f"max_memory must be a positive number of bytes, got {max_memory!r}")
        self._comm = Comm(process_group)
        self._src, self._dst = src, dst
        self._names, self._budget = names, max_memory
        self._delta, self._verify = bool(delta), bool(verify)
        self._cache: PlanCache[Any] = PlanCache(1)
        self._geometry: _Geometry | None = None
        self._held: dict[int, int | None] = {}  # wave -> version this rank's targets hold
        self._sent: dict[int, int | None] = {}  # wave -> version of this rank's snapshots
        self._snapshots: dict[_Key, torch.Tensor] = {}
        self._marks: dict[str, tuple[tuple[int, int], ...]] = {}  # target -> as we left it
        self._committed: int | None = None
        self._push: _Push | None = None

    # ---- what a caller can ask

    @property
    def version(self) -> int | None:
        """The version this rank's targets hold (None before the first commit, after
        :meth:`invalidate`, or when its waves hold different versions)."""
        seen = set(self._held.values())
        if not self._held or len(seen) != 1:
            return None
        return next(iter(seen))

    @property
    def committed(self) -> int | None:
        """The last version every rank committed."""
        return self._committed

    @property
    def snapshot_bytes(self) -> int:
        """Bytes this rank keeps of what it last sent (the cost of delta mode)."""
        return sum(t.numel() * t.element_size() for t in self._snapshots.values())

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
        self._held.clear()
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
            local = _Local.of(self._src, self._dst, self._names, self._budget, comm)
            entry, cached = _plan(local, comm, self._names, self._budget, self._cache)
            if self._geometry is None or self._geometry.plan is not entry.plan:
                self._new_plan(entry)
            self._notice_foreign_writes(local)
            waves = len(entry.plan.waves)

            def agree() -> dict[str, Any]:  # a bad version fails every rank, not just its own
                if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                    raise UsageError(f"a push's version is an int >= 0, got {version!r}")
                return {
                    "version": version,
                    "committed": self._committed,
                    "held": [self._held.get(w) for w in range(waves)],
                    "sent": [self._sent.get(w) if self._delta else None for w in range(waves)],
                }

            _, table = comm.run_everywhere("sync: agreeing on the version", agree)
            _check_versions(version, table)
            if self._verify:
                _check_sources(entry, local, comm)
        self._push = _Push(
            version=version,
            local=local,
            entry=entry,
            cached=cached,
            held=[t["held"] for t in table],
            sent=[t["sent"] for t in table],
            start=start,
        )

    def update(self) -> None:
        """Move the data of the push begun (collective); see the module doc for when it
        writes into the targets. On a failure every rank raises
        :class:`~reshard_svc.errors.TransferAbortedError` and the push is over."""
        push = self._require("update", moved=False)
        plan = push.entry.plan
        hold = len(plan.waves) <= 1
        geometry = self._geometry
        if geometry is None:  # pragma: no cover (begin() set it)
            raise UsageError("update() before begin()")
        landing = _Landing(plan, push.local.dst, push.entry.arena, hold, self, push.version)
        codec = (
            _Codec(session=self, push=push, geometry=geometry, landing=landing, hold=hold)
            if self._delta
            else None
        )
        push.landing, push.codec = landing, codec
        comm = self._comm
        try:
            with torch.no_grad(), collector_paused():
                execute(
                    plan,
                    _HeldSource(push.local.src, push.entry.dtypes),
                    comm,
                    landing,
                    arena=push.entry.arena,
                    verify=self._verify,
                    label="sync ",
                    codec=codec,
                )
        except Exception as e:
            self._push = None
            self._remember(landing.updated, push.local.dst)
            done = tuple(landing.updated)
            rest = tuple(n for n in plan.tensors if n not in set(done))
            failures = e.failures if isinstance(e, DistributedError) else {comm.rank: str(e)}
            raise TransferAbortedError(
                f"{e}. Push of version {push.version}: {len(done)} target tensor(s) were "
                f"written whole before the failure (TransferAbortedError.updated); the other "
                f"{len(rest)} are untouched and every rank keeps the version it had",
                failures,
                updated=done,
                untouched=rest,
            ) from e
        self._remember(landing.updated, push.local.dst)
        push.moved = True

    def commit(self) -> SyncResult:
        """Write what ``update()`` held back and record the version (collective)."""
        push = self._require("commit", moved=True)
        landing, codec = push.landing, push.codec
        if landing is None:  # pragma: no cover (update() set it)
            raise UsageError("commit() before update()")

        def write() -> None:
            with torch.no_grad():
                landing.write_parked()
                if codec is not None:
                    codec.write_parked()

        try:
            self._comm.run_everywhere("sync: committing", write)
        finally:
            self._push = None
            self._remember(landing.updated, push.local.dst)
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
        )

    def abort(self) -> None:
        """Drop the push in flight after ``begin()`` or ``update()`` (every rank calls it
        instead of ``commit()``): nothing held back is written, every version stays."""
        self._push = None

    # ---- bookkeeping

    def _require(self, what: str, *, moved: bool) -> _Push:
        push = self._push
        if push is None:
            raise UsageError(f"{what}() with no push begun: call begin(version) first")
        if push.moved != moved:
            raise UsageError(
                f"{what}() " + ("before update()" if moved else "after update(): call commit()")
            )
        return push

    def _new_plan(self, entry: _Entry) -> None:
        """A plan the session has not run. The same plan made again (every rank re-plans
        when one rank's session is new) keeps what the session recorded; any other plan
        starts from nothing."""
        same = self._geometry is not None and self._geometry.plan_id == entry.plan_id
        self._geometry = _Geometry.of(entry)
        if not same:
            self._held.clear()
            self._sent.clear()
            self._snapshots.clear()
            self._marks.clear()

    def _notice_foreign_writes(self, local: _Local) -> None:
        if self._geometry is None:
            return
        for name, placed in local.dst.items():
            if self._marks.get(name) != _mark(placed):
                wave = self._geometry.wave_of_name.get(name)
                if wave is not None:
                    self._held.pop(wave, None)

    def _wrote(self, wave: int, version: int) -> None:
        self._held[wave] = version

    def _remember(self, names: list[str], dst: Mapping[str, Placed]) -> None:
        """How the targets written by a push are left, once the push wrote all it will
        (targets can share memory, as a fused engine buffer's views do, so one written
        late moves the counter of one written early)."""
        for name in names:
            if name in dst:
                self._marks[name] = _mark(dst[name])

    def _kept(self, wave: int, version: int) -> None:
        self._sent[wave] = version


def _mark(placed: Placed) -> tuple[tuple[int, int], ...]:
    """Where a target's memory is and how often it has been written (torch counts every
    in-place write of a tensor and its views)."""
    return tuple((t.data_ptr(), t._version) for _, t in sorted(placed.local.items()))


def _check_versions(version: int, table: list[Any]) -> None:
    other = [(r, t["version"]) for r, t in enumerate(table) if t["version"] != version]
    if other:
        shown = ", ".join(f"rank {r}: {v}" for r, v in other[:5])
        raise TransferError(
            f"every rank must push the same version: this rank pushes {version}, {shown}"
        )
    done = [(t["committed"], r) for r, t in enumerate(table) if t["committed"] is not None]
    if done:
        last, rank = max(done)
        if version <= last:
            raise TransferError(
                f"version {version} does not come after version {last}, which rank {rank} "
                "committed: versions must go up (a restarted trainer pushes a new version)"
            )


def _pieces_sent(plan: TransferPlan, rank: int, geometry: _Geometry | None) -> int:
    if geometry is None:
        return 0
    return sum(
        1 for w in plan.waves for p in w.pieces if geometry.reads[p.read].reader == rank != p.dest
    )


# ---- the destination and the codec


class _Parking:
    """A wave is written once every rank has it, or, holding, parked until commit."""

    hold: bool
    parked: list[Wave]

    def wave_done(self, wave: Wave) -> None:
        if self.hold:
            self.parked.append(wave)
        else:
            self._write(wave)

    def write_parked(self) -> None:
        for wave in self.parked:
            self._write(wave)
        self.parked.clear()

    def _write(self, wave: Wave) -> None:
        raise NotImplementedError


class _Landing(_Parking, _Staging):
    """A push's destination on this rank: whole pieces land in staging (the plan's arena),
    deltas are decoded and kept; a wave is written into the targets once every rank has
    it (or at commit, when it is held)."""

    def __init__(
        self,
        plan: TransferPlan,
        dst: Mapping[str, Placed],
        arena: Arena,
        hold: bool,
        session: WeightSync,
        version: int,
    ) -> None:
        super().__init__(plan, dst, arena)
        self.hold, self.session, self.version = hold, session, version
        self.whole: dict[int, dict[Piece, None]] = {}  # target -> pieces staged whole
        self.patches: list[tuple[Piece, torch.Tensor | None, torch.Tensor]] = []
        self.parked: list[Wave] = []

    def region(self, piece: Piece) -> torch.Tensor:
        """The piece's region of its target tensor."""
        t = self.plan.targets[piece.target]
        return self.dst[t.tensor].local[t.box][piece.box.slices_in(t.box)]

    def view(self, piece: Piece) -> torch.Tensor:
        self.whole.setdefault(piece.target, {})[piece] = None
        return super().view(piece)

    def keep_patch(self, piece: Piece, where: torch.Tensor | None, values: torch.Tensor) -> None:
        self.patches.append((piece, where, values))

    def _write(self, wave: Wave) -> None:
        geometry = self.session._geometry
        wi = geometry.wave_index[id(wave)] if geometry is not None else 0
        self.session._held.pop(wi, None)  # until the wave is whole: a failure here forgets it
        for ti, staged in self.staged.items():
            t = self.plan.targets[ti]
            into = self.dst[t.tensor].local[t.box]
            pieces = self.whole[ti]
            if sum(p.box.numel for p in pieces) == t.box.numel:
                into.copy_(staged)
            else:
                for p in pieces:
                    at = p.box.slices_in(t.box)
                    into[at].copy_(staged[at])
        for p, where, values in self.patches:
            delta.patch(self.region(p), where, values)
        self.staged.clear()
        self.whole.clear()
        self.patches.clear()
        names = wave.tensors if hasattr(wave, "tensors") else ()
        for name in names:
            if name in self.dst:
                self.dst[name].fill_padding()
        self.session._wrote(wi, self.version)
        self.updated.extend(names)


@dataclass(kw_only=True)
class _Codec(_Parking):
    """Each piece a rank sends to another: a delta against what it last sent when the
    receiver holds that version, else the whole piece; and, once the wave is written,
    the sender's record brought up to date."""

    session: WeightSync
    push: _Push
    geometry: _Geometry
    landing: _Landing
    hold: bool
    bytes_sent: int = 0
    bytes_received: int = 0
    deltas: int = 0
    wholes: int = 0
    #: wave -> {region: the delta sent, or the source view to copy at the write}
    pending: dict[int, dict[_Key, delta.Delta | torch.Tensor]] = field(default_factory=dict)
    encoded: dict[_Key, delta.Delta] = field(default_factory=dict)
    parked: list[Wave] = field(default_factory=list)

    def _eligible(self, p: Piece, wave: int) -> bool:
        sender = self.geometry.reads[p.read].reader
        base = self.push.sent[sender][wave]
        return base is not None and self.push.held[p.dest][wave] == base

    def encode(self, piece: Piece, data: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        wave = self.geometry.wave_of_target[piece.target]
        key = (piece.read, piece.box)
        mine = self.pending.setdefault(wave, {})
        old = self.session._snapshots.get(key)
        if old is None or not self._eligible(piece, wave):
            mine.setdefault(key, data)
            self.wholes += 1
            self.bytes_sent += piece.nbytes
            return 0, None
        d = self.encoded.get(key)
        if d is None:
            d = self.encoded[key] = delta.encode(old, data, raw_payload=False)
            mine[key] = d if d.encoding in (delta.Encoding.RUNS, delta.Encoding.GAPS) else data
        self.deltas += 1
        if d.encoding is delta.Encoding.RAW:
            self.bytes_sent += piece.nbytes
            return 0, None
        self.bytes_sent += d.payload.numel()
        return int(d.encoding), d.payload

    def decode(self, piece: Piece, encoding: int, payload: torch.Tensor, dest: Any) -> None:
        wave = self.geometry.wave_of_target[piece.target]
        sender = self.geometry.reads[piece.read].reader
        self.bytes_received += payload.numel()
        if encoding and not self._eligible(piece, wave):
            raise DistributedError(
                f"rank {sender} sent a delta of {self.landing.plan.targets[piece.target].tensor!r}"
                " to a rank that does not hold the version it is against"
            )
        dtype = self.push.entry.dtypes[self.geometry.reads[piece.read].tensor]
        if encoding == delta.Encoding.RAW:
            if payload.numel() != piece.nbytes:
                raise DistributedError(
                    f"rank {sender} sent {payload.numel()} bytes for a piece of {piece.nbytes}"
                )
            self.landing.view(piece).copy_(payload.view(dtype).view(piece.box.sizes))
            return
        where, values = delta.decode(encoding, payload, piece.box.numel, dtype)
        if self.session._verify:  # patched in staging, so the CRC32C is checked before writing
            staged = self.landing.view(piece)
            staged.copy_(self.landing.region(piece))
            delta.patch(staged, where, values)
        else:
            self.landing.keep_patch(piece, where, values)

    def wave_done(self, wave: Wave) -> None:
        self.encoded.clear()
        super().wave_done(wave)

    def _write(self, w: Wave) -> None:
        wave = self.geometry.wave_index[id(w)]
        snapshots = self.session._snapshots
        self.session._sent.pop(wave, None)  # until every record of the wave is new
        for key, what in self.pending.pop(wave, {}).items():
            if isinstance(what, delta.Delta):
                delta.patch(snapshots[key], what.where, what.values)
            elif key in snapshots:
                snapshots[key].copy_(what)
            else:
                snapshots[key] = what.contiguous().clone()
        self.session._kept(wave, self.push.version)
