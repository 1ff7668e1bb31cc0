"""Plan a live weight transfer between two meshes of one world: who sends which box to whom.

Pure: every input is the gathered description of both sides (each tensor's dtype, shape and
distinct boxes with the ranks holding them), so every rank computes the same plan with no
communication. The plan:

- resolves target names to sources: one source, or the concatenation of several along a
  dim (:class:`Cat`: fused ``qkv_proj`` = cat(q, k, v)). Fusion is only offsets: a source
  box is shifted into the target's coordinates, so no rank ever builds a full tensor;
- refuses, before any byte moves, a target with no source, a source no target uses, a shape
  or dtype that differs, or sources whose holders do not tile them (:class:`TransferError`);
- gives every target rank each byte it needs exactly once: a local copy when it holds the
  source itself, else from the least-loaded rank among those holding it (ties rotate with
  the receiver), so sending spreads over every trainer replica;
- groups whole target tensors into buckets whose send, receive and staging bytes fit the
  budget on every rank; a failure can then be confined to one bucket (see
  :mod:`reshard_svc.runtime.transfer`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from reshard_svc.errors import InconsistentIndexError, TransferError
from reshard_svc.layout.box import Box, check_tiling, overlaps

__all__ = ["Bucket", "Cat", "Move", "RankWork", "Side", "TransferPlan", "plan_transfer"]


@dataclass(frozen=True)
class Cat:
    """A target made of several sources concatenated along ``dim`` (in this order)."""

    sources: tuple[str, ...]
    dim: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.sources, str) or not self.sources:
            raise TransferError(f"Cat({self.sources!r}) needs a non-empty sequence of source names")
        object.__setattr__(self, "sources", tuple(self.sources))
        for s in self.sources:
            if not isinstance(s, str):
                raise TransferError(f"Cat source names must be strings, got {s!r}")


@dataclass(frozen=True)
class Side:
    """One tensor as the whole world holds it: dtype, shape, and each distinct box with the
    ranks (in the transfer's group) that hold it."""

    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    boxes: tuple[tuple[Box, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Move:
    """``sender``'s view of ``src[src_box]`` at ``src_piece`` lands in ``receiver``'s view
    of ``dst[dst_box]`` at ``dst_piece`` (pieces relative to their boxes)."""

    src: str
    src_box: Box
    src_piece: Box
    dst: str
    dst_box: Box
    dst_piece: Box
    sender: int
    receiver: int
    nbytes: int


@dataclass(frozen=True)
class RankWork:
    """What one rank does in one bucket: bytes out per peer, in per peer, copies in place,
    and the target boxes it stages (then swaps in)."""

    sends: tuple[tuple[int, tuple[Move, ...]], ...]
    recvs: tuple[tuple[int, tuple[Move, ...]], ...]
    local: tuple[Move, ...]
    staged: tuple[tuple[str, Box], ...]


@dataclass(frozen=True)
class Bucket:
    """Whole target tensors moved, checked and swapped in together."""

    tensors: tuple[str, ...]
    moves: tuple[Move, ...]
    staged: tuple[tuple[int, str, Box], ...]

    def work(self, rank: int) -> RankWork:
        sends: dict[int, list[Move]] = {}
        recvs: dict[int, list[Move]] = {}
        local: list[Move] = []
        for m in self.moves:
            if m.sender == m.receiver == rank:
                local.append(m)
            elif m.sender == rank:
                sends.setdefault(m.receiver, []).append(m)
            elif m.receiver == rank:
                recvs.setdefault(m.sender, []).append(m)
        return RankWork(
            tuple((p, tuple(ms)) for p, ms in sorted(sends.items())),
            tuple((p, tuple(ms)) for p, ms in sorted(recvs.items())),
            tuple(local),
            tuple((name, box) for r, name, box in self.staged if r == rank),
        )


@dataclass(frozen=True)
class TransferPlan:
    """The buckets, in order, and per-rank byte counts (sent, received, staged at peak)."""

    buckets: tuple[Bucket, ...]
    world: int
    sent: tuple[int, ...]
    received: tuple[int, ...]
    copied: tuple[int, ...]
    peak: tuple[int, ...]
    _work: dict[int, tuple[RankWork, ...]] = field(default_factory=dict, compare=False, repr=False)

    def work(self, rank: int) -> tuple[RankWork, ...]:
        """This rank's share of every bucket (computed once per rank)."""
        if rank not in self._work:
            self._work[rank] = tuple(b.work(rank) for b in self.buckets)
        return self._work[rank]

    @cached_property
    def tensors(self) -> tuple[str, ...]:
        return tuple(name for b in self.buckets for name in b.tensors)


def plan_transfer(
    src: Mapping[str, Side],
    dst: Mapping[str, Side],
    names: Mapping[str, str | Cat] | None,
    world: int,
    budget: int,
) -> TransferPlan:
    """The transfer plan for targets ``dst`` from sources ``src`` (see the module doc).

    ``names`` maps a target name to its source name or :class:`Cat`; targets it does not
    mention take the source of the same name. Raises :class:`TransferError` on any
    mismatch, naming the tensor; the same inputs give the same plan on every rank.
    """
    sources = _resolve(src, dst, names or {})
    load = [0] * world
    per_tensor = []
    for name in sorted(dst):
        moves = _moves(name, dst[name], sources[name], src, load)
        per_tensor.append((name, moves, _staged(dst[name])))
    return _bucketed(per_tensor, dst, world, budget)


# ---- names


def _resolve(
    src: Mapping[str, Side], dst: Mapping[str, Side], names: Mapping[str, str | Cat]
) -> dict[str, list[tuple[str, int, int]]]:
    """Target name -> [(source name, offset along dim, dim)], checked."""
    for target in names:
        if target not in dst:
            raise TransferError(
                f"names maps target {target!r}, but no rank passed a target tensor by that "
                f"name (targets: {_few(dst)})"
            )
    out: dict[str, list[tuple[str, int, int]]] = {}
    for name in sorted(dst):
        how = names.get(name, name)
        out[name] = _components(name, dst[name], how, src)
    used = {s for parts in out.values() for s, _, _ in parts}
    unused = sorted(set(src) - used)
    if unused:
        raise TransferError(
            f"source tensor(s) {_few(unused)} are used by no target: map them in names= "
            "or leave them out of the source state dict"
        )
    return out


def _components(
    name: str, target: Side, how: str | Cat, src: Mapping[str, Side]
) -> list[tuple[str, int, int]]:
    if isinstance(how, str):
        how, single = Cat((how,), 0), True
    elif isinstance(how, Cat):
        single = False
    else:
        raise TransferError(f"names[{name!r}] must be a source name or a Cat, got {how!r}")
    missing = [s for s in how.sources if s not in src]
    if missing:
        raise TransferError(
            f"target {name!r} needs source(s) {_few(missing)}, which no rank passed "
            f"(sources: {_few(src)})"
        )
    ndim = len(target.shape)
    dim = how.dim + ndim if how.dim < 0 else how.dim
    if not single and not 0 <= dim < ndim:
        raise TransferError(f"target {name!r}: Cat dim {how.dim} is out of range for {ndim} dims")
    parts: list[tuple[str, int, int]] = []
    offset = 0
    for s in how.sources:
        side = src[s]
        if side.dtype != target.dtype:
            raise TransferError(
                f"target {name!r} is {target.dtype} but source {s!r} is {side.dtype}: cast one "
                "side first (transfer never converts dtypes)"
            )
        expect = list(target.shape)
        if not single:
            expect[dim] = side.shape[dim] if len(side.shape) == ndim else -1
        if list(side.shape) != expect:
            raise TransferError(
                f"target {name!r} has shape {tuple(target.shape)} but source {s!r} has "
                f"{tuple(side.shape)}" + ("" if single else f" (concatenated along dim {dim})")
            )
        parts.append((s, offset, dim))
        offset += side.shape[dim] if ndim else 0
    if not single and offset != target.shape[dim]:
        raise TransferError(
            f"target {name!r} has {target.shape[dim]} along dim {dim}, but its sources "
            f"{_few(how.sources, order=False)} add up to {offset}"
        )
    return parts


def _few(items: Iterable[str], order: bool = True) -> str:
    items = sorted(items) if order else list(items)
    shown = ", ".join(repr(i) for i in items[:5])
    return shown + (f" and {len(items) - 5} more" if len(items) > 5 else "") if items else "none"


# ---- moves


def _shift(box: Box, dim: int, by: int) -> Box:
    if not by:
        return box
    offs = list(box.offsets)
    offs[dim] += by
    return Box.trusted(tuple(offs), box.sizes)


def _moves(
    name: str,
    target: Side,
    parts: Sequence[tuple[str, int, int]],
    src: Mapping[str, Side],
    load: list[int],
) -> list[Move]:
    held: list[tuple[str, Box, Box, tuple[int, ...], int, int]] = []
    for s, offset, dim in parts:
        side = src[s]
        try:
            check_tiling(side.shape, [b for b, _ in side.boxes], f"source {s!r}")
        except InconsistentIndexError as e:
            raise TransferError(
                f"{e}: the ranks passing {s!r} must together hold each element once per "
                "replica (pass it with one layout)"
            ) from None
        for box, holders in side.boxes:
            held.append((s, box, _shift(box, dim, offset), holders, offset, dim))
    wanted = [(box, r) for box, holders in target.boxes for r in holders]
    moves: list[Move] = []
    for o in overlaps([h[2] for h in held], [w[0] for w in wanted]):
        s, src_box, shifted, holders, offset, dim = held[o.src]
        dst_box, receiver = wanted[o.dst]
        nbytes = o.box.numel * target.itemsize
        sender = receiver if receiver in holders else _least_loaded(holders, load, receiver)
        if sender != receiver:
            load[sender] += nbytes
        moves.append(
            Move(
                s,
                src_box,
                _shift(o.box, dim, -offset).relative_to(src_box),
                name,
                dst_box,
                o.box.relative_to(dst_box),
                sender,
                receiver,
                nbytes,
            )
        )
    return moves


def _least_loaded(holders: Sequence[int], load: Sequence[int], receiver: int) -> int:
    k = len(holders)
    start = receiver % k
    rotated = [holders[(start + i) % k] for i in range(k)]
    return min(rotated, key=lambda h: load[h])


def _staged(target: Side) -> list[tuple[int, Box, int]]:
    return [(r, box, box.numel * target.itemsize) for box, hs in target.boxes for r in hs]


# ---- buckets


def _bucketed(
    per_tensor: Sequence[tuple[str, list[Move], list[tuple[int, Box, int]]]],
    dst: Mapping[str, Side],
    world: int,
    budget: int,
) -> TransferPlan:
    sent, received, copied, peak = [0] * world, [0] * world, [0] * world, [0] * world
    buckets: list[Bucket] = []
    cur: list[tuple[str, list[Move], list[tuple[int, Box, int]]]] = []
    cur_cost = [0] * world

    def close() -> None:
        if cur:
            buckets.append(
                Bucket(
                    tuple(n for n, _, _ in cur),
                    tuple(m for _, ms, _ in cur for m in ms),
                    tuple((r, n, b) for n, _, st in cur for r, b, _ in st),
                )
            )
            for r in range(world):
                peak[r] = max(peak[r], cur_cost[r])
        cur.clear()
        cur_cost[:] = [0] * world

    for name, moves, staged in per_tensor:
        cost = [0] * world
        for m in moves:
            if m.sender == m.receiver:
                copied[m.sender] += m.nbytes
                continue
            cost[m.sender] += m.nbytes
            cost[m.receiver] += m.nbytes
            sent[m.sender] += m.nbytes
            received[m.receiver] += m.nbytes
        for r, _, nbytes in staged:
            cost[r] += nbytes
        worst = max(range(world), key=lambda r: cost[r])
        if cost[worst] > budget:
            raise TransferError(
                f"target {name!r} alone needs {cost[worst]} bytes of buffers on rank {worst} "
                f"(send, receive and staging), more than max_memory={budget}: raise max_memory"
            )
        if any(cur_cost[r] + cost[r] > budget for r in range(world)):
            close()
        cur.append((name, moves, staged))
        cur_cost[:] = [a + b for a, b in zip(cur_cost, cost)]
    close()
    return TransferPlan(
        tuple(buckets), world, tuple(sent), tuple(received), tuple(copied), tuple(peak)
    )
