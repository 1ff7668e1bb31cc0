"""Live weight sync: move tensors from one mesh's shards into another's, shard to shard.

Every rank of the group calls :func:`transfer`, in the same order. Trainer ranks pass their
state dict as ``src``, inference ranks theirs as ``dst`` (filled in place); a rank in both
meshes passes both. Values are DTensors on any sub-mesh, plain tensors, ShardedTensors or
:class:`~reshard_svc.runtime.state_dict.LocalShard` (an engine's own shards, padding
declared). Each rank passes only the keys it holds: pipeline stages pass their own layers.
The steps:

1. **describe** — each rank lists the boxes it holds of each tensor on each side (no data);
2. **plan** — on the first call, one all-gather of those descriptions
   (:func:`~reshard_svc.runtime.targets.gather`, as ``save`` and ``load`` use), then every
   rank computes the same :class:`~reshard_svc.plan.transfer.TransferPlan`. Later calls
   with the same layouts reuse it after one 16-byte all-reduce that confirms every rank hit
   the same plan, so they only move data;
3. **move** — the plan runs on the one executor (:mod:`reshard_svc.runtime.executor`), wave
   by wave (whole target tensors, bounded by ``max_memory`` on every rank): point-to-point
   sends (NCCL on CUDA, gloo on CPU) into staging buffers carved from a buffer kept with the
   cached plan;
4. **swap** — once every rank has its wave whole, staging is copied into the targets (and
   a LocalShard's padding filled).

All or nothing, per wave: a failure on any rank before the swap makes every rank raise
:class:`~reshard_svc.errors.TransferAbortedError`, whose ``updated`` names the target
tensors swapped in by earlier waves (whole, on every rank); every other target is
untouched. When everything fits in ``max_memory`` there is one wave, so a failed transfer
changes nothing. ``verify=True`` also checks that every replica of a source agrees and that
every piece lands with the CRC32C it was sent with, before anything is swapped in.

This is the one-shot form. An RL loop that pushes every step keeps a
:class:`~reshard_svc.sessions.sync.WeightSync` instead: versioned pushes that send only the
elements that changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc._collector import collector_paused
from reshard_svc.errors import (
    DistributedError,
    StateDictError,
    TransferAbortedError,
    TransferError,
)
from reshard_svc.layout import Box
from reshard_svc.plan.budget import Budget
from reshard_svc.plan.cache import PlanCache
from reshard_svc.plan.items import Piece, Read, Wave
from reshard_svc.plan.transfer import Cat, TransferPlan, plan_transfer
from reshard_svc.runtime.buffers import Arena
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.executor import Destination, execute
from reshard_svc.runtime.state_dict import flatten
from reshard_svc.runtime.targets import (
    Placed,
    check_replicas,
    describe,
    gather,
    replica_crcs,
    replicated,
)

__all__ = ["DEFAULT_CACHE", "PlanCache", "TransferResult", "transfer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TransferResult:
    """What one rank did: target names updated, waves run, its bytes out/in/copied,
    whether the plan came from the cache, and the wall time."""

    updated: tuple[str, ...]
    buckets: int
    bytes_sent: int
    bytes_received: int
    bytes_copied: int
    plan_cached: bool
    seconds: float


@dataclass(kw_only=True)
class TransferEntry:
    """A cached plan: its world-wide id, the plan, the source boxes that have replicas,
    and this rank's reusable exchange and staging memory."""

    plan_id: int
    plan: TransferPlan
    dtypes: dict[str, torch.dtype]  # every source tensor's, as its holders pass it
    replicated: dict[str, list[Box]]
    arena: Arena


#: Plans of this process, by this rank's own description. A hit is used only when every
#: rank of the group hits the same plan (one all-reduce), so a layout that changed on any
#: rank re-plans everywhere. Entries keep their buffers (as RL stacks keep their transfer
#: buffers): ``clear()`` frees them.
DEFAULT_CACHE: PlanCache[Any] = PlanCache(8)


def transfer(
    src: Mapping[str, Any] | None,
    dst: Mapping[str, Any] | None,
    *,
    names: Mapping[str, str | Cat] | None = None,
    process_group: Any = None,
    max_memory: int | str | None = None,
    plan_cache: PlanCache[Any] | None = DEFAULT_CACHE,
    verify: bool = False,
) -> TransferResult:
    """Fill the target tensors ``dst`` from the source tensors ``src`` across ranks.

    Collective over ``process_group`` (default: the world): every rank calls it, passing
    ``src`` if it holds source tensors, ``dst`` if it holds targets, both if both, else
    ``None``. Nested dicts flatten to dotted names; a rank passes only the keys it holds.

    ``names`` maps a target name to its source name, or to :class:`Cat` of several sources
    (``Cat(("q.weight", "k.weight", "v.weight"), dim=0)``); unmapped targets take the
    source of the same name. Mismatches raise :class:`~reshard_svc.errors.TransferError`
    on every rank before any byte moves. ``max_memory`` bounds each rank's send, receive
    and staging buffers per wave. ``plan_cache=None`` re-plans on every call. ``verify``
    compares the CRC32Cs of every source replica and of every piece as sent and as landed
    (a mismatch aborts before the swap).
    """
    start = time.perf_counter()
    comm = Comm(process_group)
    # No full collection mid-call (reshard_svc._collector): an RL loop calls this every few
    # steps, and a collection over a torch process's heap costs about 0.1 s on one rank,
    # which every other rank then waits for at the next wave.
    with torch.no_grad(), collector_paused():
        budget = Budget.of(max_memory, "transfer")
        local = LocalSides.of(src, dst, names, budget, comm)
        entry, cached = agreed_plan(local, comm, names, budget, plan_cache)
        plan = entry.plan
        if verify:
            check_sources(entry, local, comm)
        into = Staging(plan, local.dst, entry.arena)
        try:
            execute(
                plan,
                HeldSource(local.src, entry.dtypes),
                comm,
                into,
                arena=entry.arena,
                verify=verify,
                label="transfer ",
            )
        except Exception as e:
            done = tuple(into.updated)
            rest = tuple(n for n in plan.tensors if n not in set(done))
            failures = e.failures if isinstance(e, DistributedError) else {comm.rank: str(e)}
            raise TransferAbortedError(
                f"{e}. {len(done)} target tensor(s) were updated whole before the failure "
                f"(TransferAbortedError.updated); the other {len(rest)} are untouched",
                failures,
                updated=done,
                untouched=rest,
            ) from e
    rank = comm.rank
    return TransferResult(
        updated=tuple(into.updated),
        buckets=len(plan.waves),
        bytes_sent=plan.sent[rank],
        bytes_received=plan.received[rank],
        bytes_copied=plan.copied[rank],
        plan_cached=cached,
        seconds=time.perf_counter() - start,
    )


# ---- describe


@dataclass(frozen=True, kw_only=True)
class LocalSides:
    """This rank's sources and targets, or the error describing them raised (reported to
    every rank at the plan's agreement), and the key of its description."""

    src: dict[str, Placed]
    dst: dict[str, Placed]
    error: str | None
    key: str

    @classmethod
    def of(
        cls,
        src: Mapping[str, Any] | None,
        dst: Mapping[str, Any] | None,
        names: Mapping[str, str | Cat] | None,
        budget: Budget,
        comm: Comm,
    ) -> LocalSides:
        try:
            s, d = _placed(src, "src"), _placed(dst, "dst")
        except Exception as e:  # reported to every rank by the layout exchange
            return cls(src={}, dst={}, error=f"{type(e).__name__}: {e}", key="")
        me = {
            side: {n: p.describe() for n, p in sorted(ps.items())}
            for side, ps in (("src", s), ("dst", d))
        }
        key = json.dumps([me, _names_json(names), budget.total, comm.rank, comm.world])
        return cls(src=s, dst=d, error=None, key=key)

    def sides(self) -> dict[str, dict[str, Placed]]:
        if self.error is not None:
            raise StateDictError(self.error)
        return {"src": self.src, "dst": self.dst}


def _placed(state: Mapping[str, Any] | None, side: str) -> dict[str, Placed]:
    if state is None:
        return {}
    out = {}
    for name, leaf in flatten(state).items():
        if leaf.kind == "extra":
            raise StateDictError(
                f"{side}[{name!r}] is a {type(leaf.value).__name__}, not a tensor: transfer "
                "moves tensors only"
            )
        out[name] = describe(leaf)
    return out


def _names_json(names: Mapping[str, str | Cat] | None) -> Any:
    if names is None:
        return None
    return {
        k: ([list(v.sources), v.dim] if isinstance(v, Cat) else v)
        for k, v in sorted(names.items(), key=lambda kv: str(kv[0]))
    }


# ---- plan


def agreed_plan(
    local: LocalSides,
    comm: Comm,
    names: Mapping[str, str | Cat] | None,
    budget: Budget,
    cache: PlanCache[Any] | None,
) -> tuple[TransferEntry, bool]:
    hit = cache.get(local.key) if cache is not None and local.error is None else None
    high, neg_low = comm.all_reduce_max([hit.plan_id if hit else -1, -(hit.plan_id if hit else -1)])
    if hit is not None and high == -neg_low and high >= 0:
        return hit, True  # every rank hit the same plan
    agreed = {"names": _names_json(names), "budget": budget.total}
    got = gather(comm, "transfer: describing tensors", lambda: (local.sides(), agreed))
    for rank, theirs in enumerate(got.extras):
        for what in ("names", "budget"):
            if theirs[what] != agreed[what]:
                raise TransferError(
                    f"rank {rank} passed a different {'names' if what == 'names' else 'max_memory'}"
                    " than this rank: every rank must pass the same"
                )
    plan = plan_transfer(got.holdings["src"], got.holdings["dst"], names, comm.world, budget)
    everything = json.dumps(
        {
            s: {
                n: [
                    h.dtype,
                    list(h.shape),
                    [[list(x.box.offsets), list(x.box.sizes), list(x.holders)] for x in h.held],
                ]
                for n, h in hs.items()
            }
            for s, hs in got.holdings.items()
        },
        sort_keys=True,
    )
    digest = hashlib.blake2b(everything.encode(), digest_size=8).digest()
    dtypes = {n: getattr(torch, h.dtype) for n, h in got.holdings["src"].items()}
    entry = TransferEntry(
        plan_id=int.from_bytes(digest, "big") >> 2,
        plan=plan,
        dtypes=dtypes,
        replicated=replicated(got.holdings["src"]),
        arena=Arena(comm.device),
    )
    if cache is not None:
        cache.put(local.key, entry)
    return entry, False


def check_sources(entry: TransferEntry, local: LocalSides, comm: Comm) -> None:
    """Every replica of a source box holds the same bytes (``verify=True``)."""
    _, reports = comm.run_everywhere(
        "transfer: checking source replicas", lambda: replica_crcs(local.src, entry.replicated)
    )
    check_replicas(entry.replicated, reports, "transfer(verify=True)")


# ---- move and swap


class HeldSource:
    """A transfer's source: the boxes each rank holds, read from memory."""

    bytes_read = 0

    def __init__(self, placed: Mapping[str, Placed], dtypes: Mapping[str, torch.dtype]) -> None:
        self.placed, self.dtypes = placed, dtypes

    def dtype(self, tensor: str) -> torch.dtype:
        return self.dtypes[tensor]

    def read(
        self, reads: Sequence[Read], pieces: Mapping[int, list[Piece]], dest: Destination
    ) -> tuple[list[torch.Tensor], set[Piece]]:
        return [self.placed[r.tensor].local[r.origin or r.box] for r in reads], set()


class Staging:
    """A transfer's destination: each wave lands in staging buffers (from the plan's
    arena) and is copied into the targets only once every rank has it whole."""

    def __init__(self, plan: TransferPlan, dst: Mapping[str, Placed], arena: Arena) -> None:
        self.plan, self.dst, self.arena = plan, dst, arena
        self.staged: dict[int, torch.Tensor] = {}
        self.updated: list[str] = []

    def view(self, piece: Piece) -> torch.Tensor:
        t = self.plan.targets[piece.target]
        buf = self.staged.get(piece.target)
        if buf is None:
            like = self.dst[t.tensor].local[t.box]
            buf = self.staged[piece.target] = self.arena.take_like(like)
        return buf[piece.box.slices_in(t.box)]

    def take(self, piece: Piece, data: torch.Tensor) -> bool:
        return False

    def wave_done(self, wave: Wave) -> None:
        for ti, staged in self.staged.items():
            t = self.plan.targets[ti]
            self.dst[t.tensor].local[t.box].copy_(staged)
        self.staged.clear()  # views of the arena go before the next wave reuses it
        names = wave.tensors
        for name in names:
            if name in self.dst:
                self.dst[name].fill_padding()
        self.updated.extend(names)
