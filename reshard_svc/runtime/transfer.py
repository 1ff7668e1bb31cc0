"""Live weight sync: move tensors from one mesh's DTensors into another's, shard to shard.

Every rank of the group calls :func:`transfer`, in the same order. Trainer ranks pass their
state dict as ``src``, inference ranks theirs as ``dst`` (filled in place); a rank in both
meshes passes both. The steps:

1. **describe** — each rank lists the boxes it holds of each tensor on each side (no data);
2. **plan** — on the first call, one all-gather of those descriptions, then every rank
   computes the same :class:`~reshard_svc.plan.transfer.TransferPlan`. Later calls with the
   same layouts reuse it after one 16-byte all-reduce that confirms every rank hit the same
   plan, so they only move data;
3. **move** — per bucket (whole target tensors, bounded by ``max_memory`` on every rank):
   pack each peer's pieces into one buffer, exchange them point to point
   (``batch_isend_irecv``: NCCL on CUDA, gloo on CPU), unpack into staging;
4. **swap** — once every rank reports its bucket complete, copy staging into the targets.

All or nothing, per bucket: a failure on any rank before the swap makes every rank raise
:class:`~reshard_svc.errors.TransferAbortedError`, whose ``updated`` names the target
tensors swapped in by earlier buckets (whole, on every rank); every other target is
untouched. When everything fits in ``max_memory`` there is one bucket, so a failed
transfer changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reshard_svc.errors import (
    DistributedError,
    StateDictError,
    TransferAbortedError,
    TransferError,
)
from reshard_svc.layout.box import Box
from reshard_svc.plan.transfer import Cat, Move, RankWork, Side, TransferPlan, plan_transfer
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.state_dict import flatten
from reshard_svc.runtime.targets import Placed, describe

__all__ = ["PlanCache", "TransferResult", "transfer"]

logger = logging.getLogger(__name__)
DEFAULT_MAX_MEMORY = 512 * 1024 * 1024
_ALIGN = 16  # pieces start at multiples of this in a buffer, so any dtype view is aligned


@dataclass(frozen=True)
class TransferResult:
    """What one rank did: target names updated, buckets run, its bytes out/in/copied,
    whether the plan came from the cache, and the wall time."""

    updated: tuple[str, ...]
    buckets: int
    bytes_sent: int
    bytes_received: int
    bytes_copied: int
    plan_cached: bool
    seconds: float


@dataclass
class _Entry:
    """A cached plan: its world-wide id, the plan, and this rank's reusable buffer."""

    plan_id: int
    plan: TransferPlan
    scratch: _Scratch


class PlanCache:
    """The last few transfer plans of this process, keyed by this rank's own description.

    A hit is used only when every rank of the group hits the same plan (checked by one
    all-reduce), so a layout that changed on any rank re-plans everywhere.
    Each entry also keeps this rank's byte buffer for the buckets (at most ``max_memory``),
    as RL stacks keep their transfer buffers: ``clear()`` frees them.
    """

    def __init__(self, maxsize: int = 8) -> None:
        self.maxsize = maxsize
        self._plans: OrderedDict[str, _Entry] = OrderedDict()

    def get(self, key: str) -> _Entry | None:
        hit = self._plans.get(key)
        if hit is not None:
            self._plans.move_to_end(key)
        return hit

    def put(self, key: str, entry: _Entry) -> None:
        self._plans[key] = entry
        self._plans.move_to_end(key)
        while len(self._plans) > self.maxsize:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()


DEFAULT_CACHE = PlanCache()


def transfer(
    src: Mapping[str, Any] | None,
    dst: Mapping[str, Any] | None,
    *,
    names: Mapping[str, str | Cat] | None = None,
    process_group: Any = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    plan_cache: PlanCache | None = DEFAULT_CACHE,
) -> TransferResult:
    """Fill the target tensors ``dst`` from the source tensors ``src`` across ranks.

    Collective over ``process_group`` (default: the world): every rank calls it, passing
    ``src`` if it holds source tensors, ``dst`` if it holds targets, both if both, else
    ``None``. Values are DTensors (any mesh of the group, any placements), plain tensors
    (held whole by that rank) or ShardedTensors; nested dicts flatten to dotted names.

    ``names`` maps a target name to its source name, or to :class:`Cat` of several sources
    (``Cat(("q.weight", "k.weight", "v.weight"), dim=0)``); unmapped targets take the
    source of the same name. Mismatches raise :class:`~reshard_svc.errors.TransferError`
    on every rank before any byte moves. ``max_memory`` bounds each rank's send, receive
    and staging buffers per bucket. ``plan_cache=None`` re-plans on every call.
    """
    start = time.perf_counter()
    comm = Comm(process_group)
    with torch.no_grad():
        local = _Local.of(src, dst, comm, names, max_memory)
        entry, cached = _plan(local, comm, names, max_memory, plan_cache)
        plan = entry.plan
        updated = _run(plan, local, comm, entry.scratch)
    rank = comm.rank
    return TransferResult(
        updated,
        len(plan.buckets),
        plan.sent[rank],
        plan.received[rank],
        plan.copied[rank],
        cached,
        time.perf_counter() - start,
    )


# ---- describe


@dataclass
class _Local:
    """This rank's views of its source and target boxes, and their JSON description."""

    src: dict[str, Placed]
    dst: dict[str, Placed]
    error: str | None
    key: str
    description: dict[str, Any]

    @classmethod
    def of(
        cls,
        src: Mapping[str, Any] | None,
        dst: Mapping[str, Any] | None,
        comm: Comm,
        names: Mapping[str, str | Cat] | None,
        budget: int,
    ) -> _Local:
        try:
            s, d = _placed(src, comm, "src"), _placed(dst, comm, "dst")
        except Exception as e:  # reported to every rank by the layout exchange
            return cls({}, {}, f"{type(e).__name__}: {e}", "", {})
        me = {"src": _describe(s), "dst": _describe(d)}
        key = json.dumps([me, _names_json(names), budget, comm.rank, comm.world])
        return cls(s, d, None, key, me)


def _placed(state: Mapping[str, Any] | None, comm: Comm, side: str) -> dict[str, Placed]:
    if state is None:
        return {}
    out = {}
    for name, leaf in flatten(state).items():
        if leaf.kind == "extra":
            raise StateDictError(
                f"{side}[{name!r}] is a {type(leaf.value).__name__}, not a tensor: transfer "
                "moves tensors only"
            )
        out[name] = describe(leaf, comm)
    return out


def _describe(placed: Mapping[str, Placed]) -> dict[str, Any]:
    return {
        name: [
            str(p.dtype).removeprefix("torch."),
            torch.empty((), dtype=p.dtype).element_size(),
            list(p.shape),
            [[list(b.offsets), list(b.sizes)] for b in sorted(p.local)],
        ]
        for name, p in sorted(placed.items())
    }


def _names_json(names: Mapping[str, str | Cat] | None) -> Any:
    if names is None:
        return None
    return {
        k: ([list(v.sources), v.dim] if isinstance(v, Cat) else v)
        for k, v in sorted(names.items(), key=lambda kv: str(kv[0]))
    }


# ---- plan


def _plan(
    local: _Local,
    comm: Comm,
    names: Mapping[str, str | Cat] | None,
    budget: int,
    cache: PlanCache | None,
) -> tuple[_Entry, bool]:
    hit = cache.get(local.key) if cache is not None and local.error is None else None
    if hit is not None and _everyone_hit(comm, hit.plan_id):
        return hit, True
    if hit is None:
        _everyone_hit(comm, -1)  # the others may have hit: they must learn that we did not
    gathered = _exchange(local, comm, names, budget)
    src, dst = _sides(gathered, "src"), _sides(gathered, "dst")
    plan = plan_transfer(src, dst, names, comm.world, budget)
    digest = hashlib.blake2b(json.dumps(gathered).encode(), digest_size=8).digest()
    entry = _Entry(int.from_bytes(digest, "big") >> 2, plan, _Scratch())
    if cache is not None:
        cache.put(local.key, entry)
    return entry, False


def _everyone_hit(comm: Comm, plan_id: int) -> bool:
    """True when every rank found the same cached plan (one all-reduce of two int64s)."""
    if not comm.distributed or comm.world == 1:
        return plan_id >= 0
    t = torch.tensor([plan_id, -plan_id], dtype=torch.int64, device=comm.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
    high, low = int(t[0]), -int(t[1])
    return high == low and high >= 0


def _exchange(
    local: _Local, comm: Comm, names: Mapping[str, str | Cat] | None, budget: int
) -> list[dict[str, Any]]:
    """The one exchange of layouts; every rank raises if any rank could not describe its
    tensors, or the ranks disagree on ``names`` or ``max_memory``."""

    def mine() -> dict[str, Any]:
        if local.error is not None:
            raise StateDictError(local.error)
        return {**local.description, "names": _names_json(names), "budget": budget}

    _, gathered = comm.run_everywhere("transfer: describing tensors", mine)
    for rank, g in enumerate(gathered):
        for what in ("names", "budget"):
            if g[what] != gathered[0][what]:
                raise TransferError(
                    f"rank {rank} passed a different {'names' if what == 'names' else 'max_memory'}"
                    " than rank 0: every rank must pass the same"
                )
    return gathered


def _sides(gathered: list[dict[str, Any]], side: str) -> dict[str, Side]:
    meta: dict[str, tuple[str, int, tuple[int, ...], int]] = {}
    holders: dict[str, dict[Box, list[int]]] = {}
    for rank, g in enumerate(gathered):
        for name, (dtype, size, shape, boxes) in g[side].items():
            seen = meta.setdefault(name, (dtype, size, tuple(shape), rank))
            if seen[:3] != (dtype, size, tuple(shape)):
                raise TransferError(
                    f"{side} tensor {name!r} is {seen[0]} {list(seen[2])} on rank {seen[3]} "
                    f"but {dtype} {shape} on rank {rank}"
                )
            for offs, sizes in boxes:
                holders.setdefault(name, {}).setdefault(Box(tuple(offs), tuple(sizes)), []).append(
                    rank
                )
    return {
        name: Side(
            dtype,
            size,
            shape,
            tuple((b, tuple(hs)) for b, hs in sorted(holders.get(name, {}).items())),
        )
        for name, (dtype, size, shape, _) in meta.items()
    }


# ---- move and swap


def _slices(piece: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))


def _layout(moves: tuple[Move, ...]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for m in moves:
        offsets.append(pos)
        pos += _aligned(m.nbytes)
    return offsets, pos


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _Scratch:
    """One byte buffer a rank reuses for every bucket's send, receive and staging buffers
    (kept with the cached plan, so steady-state calls fault in no new pages)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.pos = 0

    def reserve(self, sizes: list[int], device: torch.device) -> None:
        need = sum(_aligned(n) for n in sizes)
        if self.buf is None or self.buf.numel() < need or self.buf.device != device:
            self.buf = None  # free the old one first
            self.buf = torch.empty(need, dtype=torch.uint8, device=device)
        self.pos = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf is None:
            raise RuntimeError("scratch used before reserve()")
        out = self.buf[self.pos : self.pos + nbytes]
        self.pos += _aligned(nbytes)
        return out

    def take_like(self, like: torch.Tensor) -> torch.Tensor:
        return self.take(like.numel() * like.element_size()).view(like.dtype).view(like.shape)


class _Bucket:
    """One bucket on this rank: buffers, the point-to-point exchange, staging, the swap."""

    def __init__(self, work: RankWork, local: _Local, comm: Comm, scratch: _Scratch) -> None:
        self.work, self.local, self.comm = work, local, comm
        sizes = [_layout(ms)[1] for _, ms in work.sends] + [_layout(ms)[1] for _, ms in work.recvs]
        views = {key: local.dst[key[0]].local[key[1]] for key in work.staged}
        scratch.reserve(sizes + [v.numel() * v.element_size() for v in views.values()], comm.device)
        self.staging = {key: scratch.take_like(v) for key, v in views.items()}
        self.scratch = scratch
        self.sends: list[tuple[int, torch.Tensor]] = []
        self.recvs: list[tuple[int, torch.Tensor]] = []

    def source(self, m: Move) -> torch.Tensor:
        return self.local.src[m.src].local[m.src_box][_slices(m.src_piece)]

    def target(self, m: Move) -> torch.Tensor:
        return self.staging[(m.dst, m.dst_box)][_slices(m.dst_piece)]

    def pack(self) -> None:
        """Fill the send buffers and allocate the receive buffers (before the exchange, so
        a failure here is caught by the agreement that follows, never mid-exchange)."""
        self.recvs = [(peer, self.scratch.take(_layout(ms)[1])) for peer, ms in self.work.recvs]
        self.sends = []
        for peer, moves in self.work.sends:
            offsets, total = _layout(moves)
            buf = self.scratch.take(total)
            for m, at in zip(moves, offsets):
                piece = self.source(m)
                buf[at : at + m.nbytes].view(piece.dtype).view(piece.shape).copy_(piece)
            self.sends.append((peer, buf))

    def exchange(self) -> None:
        group = self.comm.group
        ops = [dist.P2POp(dist.isend, buf, self._peer(p), group) for p, buf in self.sends]
        ops += [dist.P2POp(dist.irecv, buf, self._peer(p), group) for p, buf in self.recvs]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        self.sends = []

    def _peer(self, rank: int) -> int:
        return rank if self.comm.group is None else dist.get_global_rank(self.comm.group, rank)

    def move(self) -> None:
        self.exchange()
        self.unpack()

    def unpack(self) -> None:
        for (_, buf), (_, moves) in zip(self.recvs, self.work.recvs):
            offsets, _ = _layout(moves)
            for m, at in zip(moves, offsets):
                into = self.target(m)
                into.copy_(buf[at : at + m.nbytes].view(into.dtype).view(into.shape))
        for m in self.work.local:
            self.target(m).copy_(self.source(m))
        self.recvs = []

    def swap(self) -> None:
        for (name, box), staged in self.staging.items():
            self.local.dst[name].local[box].copy_(staged)


def _run(plan: TransferPlan, local: _Local, comm: Comm, scratch: _Scratch) -> tuple[str, ...]:
    updated: list[str] = []
    for i, (bucket, work) in enumerate(zip(plan.buckets, plan.work(comm.rank))):
        what = f"transfer bucket {i + 1}/{len(plan.buckets)}"
        try:
            step = _Bucket(work, local, comm, scratch)
            comm.run_everywhere(f"{what}: packing", step.pack)
            comm.run_everywhere(f"{what}: moving", step.move)
        except Exception as e:
            done = tuple(updated)
            rest = tuple(n for n in plan.tensors if n not in set(done))
            failures = e.failures if isinstance(e, DistributedError) else {comm.rank: str(e)}
            raise TransferAbortedError(
                f"{e}. {len(done)} target tensor(s) were updated whole before the failure "
                f"(TransferAbortedError.updated); the other {len(rest)} are untouched",
                failures,
                updated=done,
                untouched=rest,
            ) from e
        step.swap()
        del step  # its views of the scratch buffer go before the next bucket may regrow it
        updated.extend(bucket.tensors)
        logger.debug("%s: %d tensors swapped in", what, len(bucket.tensors))
    return tuple(updated)
