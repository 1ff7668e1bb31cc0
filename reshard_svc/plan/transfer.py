"""Plan a live weight transfer between two meshes of one world: who sends which box to whom.

Pure: the inputs are the gathered holdings of both sides (each tensor's dtype, shape and
distinct boxes with the ranks holding them), so every rank computes the same plan with no
communication. The plan:

- resolves target names to sources: one source, or the concatenation of several along a
  dim (:class:`Cat`: fused ``qkv_proj`` = cat(q, k, v)). Fusion is only offsets: a source
  box is placed at its offset in the target's coordinates, so no rank builds a full tensor;
- refuses, before any byte moves, a target with no source, a source no target uses, a shape
  or dtype that differs, or sources whose holders do not tile them (:class:`TransferError`);
- gives every target rank each byte it needs exactly once: a local copy when it holds the
  source itself, else from the least-loaded rank among those holding it (ties rotate with
  the receiver), so sending spreads over every trainer replica
  (:func:`~reshard_svc.layout.balance.least_loaded`, the rule every planner uses); a box
  that several ranks need (a target replicated on the engine: GQA KV heads, norms) is sent
  once, in stripes, and forwarded among them (a relay: :attr:`Piece.via`), so no trainer
  rank sends one copy per replica;
- packs whole target tensors into waves whose send, receive and staging bytes fit the
  budget on every rank (:func:`~reshard_svc.plan.packing.pack`); a failure can then be
  confined to one wave (see :mod:`reshard_svc.runtime.transfer`).

The plan speaks :mod:`reshard_svc.plan.items`: each source box a sender uses is a
:class:`~reshard_svc.plan.items.Read` from memory, each region moved a
:class:`~reshard_svc.plan.items.Piece`, and it runs on the same executor as ``load``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from reshard_svc.errors import InconsistentIndexError, TransferError
from reshard_svc.layout import Box, check_tiling, overlaps
from reshard_svc.layout.balance import least_loaded
from reshard_svc.plan.budget import Budget
from reshard_svc.plan.items import Held, Holdings, Piece, Read, Target, WaveBase
from reshard_svc.plan.packing import pack

__all__ = ["Cat", "Holdings", "TransferPlan", "TransferWave", "plan_transfer"]

#: A target box needed by at least this many ranks that do not hold its source, and by more
#: of them than hold it, is relayed: sent once, in stripes, and forwarded among its
#: receivers (a target replicated on the engine). Fewer receivers than source replicas are
#: each fed directly by one replica.
RELAY_FROM = 2


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


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferWave(WaveBase):
    """Whole target tensors, moved, checked and swapped in together."""

    reads: tuple[Read, ...]
    pieces: tuple[Piece, ...]
    tensors: tuple[str, ...]

    @property
    def tensors_done(self) -> int:
        return len(self.tensors)


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """The waves, in order, and per-rank byte counts (sent, received, copied in place,
    buffers at peak)."""

    targets: tuple[Target, ...]
    waves: tuple[TransferWave, ...]
    world: int
    sent: tuple[int, ...]
    received: tuple[int, ...]
    copied: tuple[int, ...]
    peak: tuple[int, ...]
    bytes_total: int
    point_to_point: bool = field(default=True, init=False)

    @property
    def tensor_count(self) -> int:
        return sum(len(w.tensors) for w in self.waves)

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(name for w in self.waves for name in w.tensors)


def plan_transfer(
    src: Mapping[str, Holdings],
    dst: Mapping[str, Holdings],
    names: Mapping[str, str | Cat] | None,
    world: int,
    budget: Budget,
) -> TransferPlan:
    """The transfer plan for targets ``dst`` from sources ``src`` (see the module doc).

    ``names`` maps a target name to its source name or :class:`Cat`; targets it does not
    mention take the source of the same name. Raises :class:`TransferError` on any
    mismatch, naming the tensor; the same inputs give the same plan on every rank.
    """
    sources = _resolve(src, dst, names or {})
    load = [0] * world
    per_tensor = [_tensor(name, dst[name], sources[name], src, load, world) for name in sorted(dst)]
    for t in per_tensor:
        worst = int(np.argmax(t.cost))
        if t.cost[worst] > budget.total:
            raise TransferError(
                f"target {t.name!r} alone needs {int(t.cost[worst])} bytes of buffers on rank "
                f"{worst} (send, receive and staging), more than max_memory={budget.total}: raise "
                "max_memory"
            )
    return _assemble(per_tensor, world, budget)


# ---- names


def _resolve(
    src: Mapping[str, Holdings], dst: Mapping[str, Holdings], names: Mapping[str, str | Cat]
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
        out[name] = _components(name, dst[name], names.get(name, name), src)
    used = {s for parts in out.values() for s, _, _ in parts}
    unused = sorted(set(src) - used)
    if unused:
        raise TransferError(
            f"source tensor(s) {_few(unused)} are used by no target: map them in names= "
            "or leave them out of the source state dict"
        )
    return out


def _components(
    name: str, target: Holdings, how: str | Cat, src: Mapping[str, Holdings]
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


# ---- one target tensor


def _shift(box: Box, dim: int, by: int) -> Box:
    if not by:
        return box
    offs = list(box.offsets)
    offs[dim] += by
    return Box.trusted(tuple(offs), box.sizes)


@dataclass(frozen=True, eq=False, kw_only=True)
class _Tensor:
    """One target tensor's reads (ids relative to the tensor), pieces (read and target ids
    relative too), targets, and what it costs each rank while in flight."""

    name: str
    reads: list[Read]
    pieces: list[Piece]
    targets: list[Target]
    cost: np.ndarray


def _tensor(
    name: str,
    target: Holdings,
    parts: Sequence[tuple[str, int, int]],
    src: Mapping[str, Holdings],
    load: list[int],
    world: int,
) -> _Tensor:
    """Pieces of one target tensor: every (target box, holder) gets each of its bytes once."""
    held: list[tuple[str, Held, Box, int, int]] = []  # source, held, shifted box, offset, dim
    for s, offset, dim in parts:
        side = src[s]
        try:
            check_tiling(side.shape, [h.box for h in side.held], f"source {s!r}")
        except InconsistentIndexError as e:
            raise TransferError(
                f"{e}: the ranks passing {s!r} must together hold each element once per "
                "replica (pass it with one layout)"
            ) from None
        held += [(s, h, _shift(h.box, dim, offset), offset, dim) for h in side.held]
    targets = [Target(tensor=name, box=h.box, holders=h.holders) for h in target.held]
    reads: dict[tuple[int, int], Read] = {}  # (held index, sender) -> read
    pieces: list[Piece] = []
    cost = np.zeros(world, dtype=np.int64)
    for t in targets:
        for r in t.holders:
            cost[r] += t.box.numel * target.itemsize  # staging

    def read_of(o_src: int, sender: int) -> Read:
        s, h, shifted, offset, _ = held[o_src]
        read = reads.get((o_src, sender))
        if read is None:
            read = reads[(o_src, sender)] = Read(
                id=len(reads),
                tensor=s,
                box=shifted,
                reader=sender,
                origin=h.box if offset else None,
            )
        return read

    for o in overlaps([h[2] for h in held], [t.box for t in targets]):
        h = held[o.src][1]
        nbytes = o.box.numel * target.itemsize
        sources = set(h.holders)
        holders = targets[o.dst].holders
        remote = [r for r in holders if r not in sources]  # the rest copy in place
        # relayed when its receivers outnumber the ranks that could send it to them
        relay = len(remote) >= RELAY_FROM and len(remote) > len(sources)
        for receiver in sorted(sources & set(holders)) if relay else holders:
            sender = least_loaded(h.holders, load, prefer={receiver: nbytes}, turn=receiver)
            if sender != receiver:
                load[sender] += nbytes
                cost[sender] += nbytes
                cost[receiver] += nbytes
            read = read_of(o.src, sender)
            pieces.append(
                Piece(read=read.id, box=o.box, target=o.dst, dest=receiver, nbytes=nbytes)
            )
        if relay:
            pieces += _relayed(
                o.box, o.dst, remote, h.holders, target.itemsize, load, cost, read_of, o.src
            )
    return _Tensor(name=name, reads=list(reads.values()), pieces=pieces, targets=targets, cost=cost)


def _relayed(
    box: Box,
    ti: int,
    remote: list[int],
    senders: Sequence[int],
    itemsize: int,
    load: list[int],
    cost: np.ndarray,
    read_of: Callable[[int, int], Read],
    src: int,
) -> list[Piece]:
    """A box that ``remote`` ranks (none holding its source) all need: cut by rows into one
    stripe per receiver; the sender sends each stripe once, to its via (a receiver, each
    in turn), and the via forwards it to the other receivers (the executor's relay round).
    So the sender sends one copy, not one per receiver, and each receiver forwards about
    one copy in all."""
    n = len(remote)
    sender = least_loaded(senders, load, turn=remote[0])
    read = read_of(src, sender)
    out = []
    for j, stripe in enumerate(_stripes(box, n)):
        nbytes = stripe.numel * itemsize
        via = remote[(j + ti) % n]
        load[sender] += nbytes
        load[via] += nbytes * (n - 1)
        cost[sender] += nbytes
        cost[via] += nbytes * (n - 1)
        for r in remote:
            cost[r] += nbytes
            out.append(Piece(read=read.id, box=stripe, target=ti, dest=r, nbytes=nbytes, via=via))
    return out


def _stripes(box: Box, n: int) -> list[Box]:
    """``box`` cut along dim 0 into at most ``n`` stripes of about equal rows."""
    if box.ndim == 0 or box.sizes[0] < 2:
        return [box]
    rows, k = box.sizes[0], min(n, box.sizes[0])
    cuts = [rows * j // k for j in range(k + 1)]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        offsets = (box.offsets[0] + a, *box.offsets[1:])
        out.append(Box.trusted(offsets, (b - a, *box.sizes[1:])))
    return out


# ---- waves


def _assemble(per_tensor: list[_Tensor], world: int, budget: Budget) -> TransferPlan:
    """Whole tensors packed into waves; read and target ids made plan-wide (0..n-1)."""
    sent, received, copied, peak = (np.zeros(world, dtype=np.int64) for _ in range(4))
    targets: list[Target] = []
    waves: list[TransferWave] = []
    total = n_reads = 0
    for start, end in pack((t.cost for t in per_tensor), world, budget.total):
        reads: list[Read] = []
        keyed: list[tuple[tuple[int, int, int, Box], Piece]] = []
        for t in per_tensor[start:end]:
            r0, t0 = n_reads, len(targets)
            reads += [_renumber(r, r0) for r in t.reads]
            n_reads += len(t.reads)
            targets += t.targets
            for p in t.pieces:
                reader = t.reads[p.read].reader
                sender = p.sender(reader)
                piece = Piece(
                    read=p.read + r0,
                    box=p.box,
                    target=p.target + t0,
                    dest=p.dest,
                    nbytes=p.nbytes,
                    via=p.via,
                )
                keyed.append(((reader, p.dest, piece.read, p.box), piece))
                total += p.nbytes
                if sender == p.dest:
                    copied[sender] += p.nbytes
                else:
                    sent[sender] += p.nbytes
                    received[p.dest] += p.nbytes
        keyed.sort(key=lambda kp: kp[0])
        names = tuple(t.name for t in per_tensor[start:end])
        waves.append(
            TransferWave(reads=tuple(reads), pieces=tuple(p for _, p in keyed), tensors=names)
        )
        peak = np.maximum(peak, sum(t.cost for t in per_tensor[start:end]))
    return TransferPlan(
        targets=tuple(targets),
        waves=tuple(waves),
        world=world,
        sent=_ints(sent),
        received=_ints(received),
        copied=_ints(copied),
        peak=_ints(peak),
        bytes_total=total,
    )


def _renumber(read: Read, base: int) -> Read:
    return Read(
        id=read.id + base, tensor=read.tensor, box=read.box, reader=read.reader, origin=read.origin
    )


def _ints(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in a)
