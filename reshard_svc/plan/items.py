"""The one vocabulary every plan speaks: ``load``, ``convert`` and ``transfer`` alike.

A plan is a sequence of *waves*; each wave is executed by every rank together
(:func:`reshard_svc.runtime.executor.execute`):

* a :class:`Read` is bytes one rank brings into the wave: rows of a stored chunk read from
  a file, or a box of a tensor the rank holds in memory (a live transfer's source);
* a :class:`Piece` is "these bytes of this box go from this holder to that one": a region
  of a read, sent by the read's rank, landing in a :class:`Target` box on ``dest``;
* a :class:`Target` is a distinct box of a target tensor and the ranks it lands on;
* :class:`Held` is a box and the ranks that hold it, and :class:`Holdings` a whole tensor
  as the ranks that pass it hold it (what planners take as input).

Items are frozen and keyword-only, so two boxes can never be swapped by position. Boxes
of reads and pieces are in the *target* tensor's coordinates; a read whose bytes sit
elsewhere in their own tensor (a source of a fused ``Cat`` target) says where in
``origin``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from reshard_svc.layout import Box

__all__ = ["Held", "Holdings", "Piece", "Plan", "Read", "Target", "Wave", "WaveBase"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Held:
    """A box of a tensor and the ranks that hold it (in the plan's process group)."""

    box: Box
    holders: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Holdings:
    """One tensor as the ranks that pass it hold it: dtype (``float32``), item size,
    global shape, each distinct box with its holders, and the layout's text when it has
    one (``tp=2|S(0)``)."""

    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    held: tuple[Held, ...]
    layout: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """A distinct box of target tensor ``tensor`` and the ranks it lands on."""

    tensor: str
    box: Box
    holders: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Read:
    """Bytes that rank ``reader`` brings into a wave: ``box`` of ``tensor``.

    From storage: bytes ``[begin, end)`` of ``file``, stored as ``encoding`` (``raw``
    row-major bytes, or a ``torch_save`` item read whole). From memory (``file`` is None):
    the box the reader holds, which sits at ``origin`` in its own tensor when that differs
    from ``box`` (the plan's coordinates).
    """

    id: int
    tensor: str
    box: Box
    reader: int
    file: str | None = None
    begin: int = 0
    end: int = 0
    encoding: str = "raw"
    origin: Box | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """Region ``box`` of read ``read`` (sent by that read's rank) lands in target
    ``target`` on rank ``dest``: ``nbytes`` bytes.

    ``via`` (a rank, or -1) relays a replicated box's stripe: the reader sends it once to
    ``via`` (itself a holder), and ``via`` forwards it to the other holders in a second
    round of the same wave, so no reader sends one copy per holder (:meth:`sender`).
    """

    read: int
    box: Box
    target: int
    dest: int
    nbytes: int
    via: int = -1

    def sender(self, reader: int) -> int:
        """The rank this piece comes from when ``reader`` read it: the reader, or its
        ``via`` for the holders that are neither the reader nor the via."""
        v = self.via
        if v < 0 or v == reader or self.dest == v or self.dest == reader:
            return reader
        return v


class Wave(Protocol):
    """One exchange: every rank reads its reads, sends its pieces, lands what it gets.
    Pieces are ordered by (reader, dest, read, box), the order of the send and receive
    buffers on every rank.

    Everything the executor reads of a wave is here. :class:`WaveBase` derives the last
    five from ``reads`` and ``pieces``; a plan that knows them cheaper (a read plan's
    templates) says so itself."""

    @property
    def reads(self) -> Sequence[Read]: ...

    @property
    def pieces(self) -> Sequence[Piece]: ...

    @property
    def tensors_done(self) -> int:
        """Tensors whose last piece is in this wave (for progress)."""
        ...

    @property
    def tensors(self) -> Sequence[str]:
        """The target tensors this wave completes (a destination fills their padding)."""
        ...

    @property
    def crosses(self) -> bool:
        """Whether any piece goes from one rank to another (every rank then exchanges)."""
        ...

    @property
    def relays(self) -> bool:
        """Whether any piece is forwarded by a via (every rank then takes a second round)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of every rank's pieces (for progress)."""
        ...

    def pieces_for(self, rank: int) -> Sequence[Piece]:
        """The pieces ``rank`` sends or receives, in the wave's order (a plan may hold one
        piece for every holder of a box: each rank expands only its own)."""
        ...


class WaveBase:
    """:class:`Wave`'s derived members computed from ``reads`` and ``pieces``."""

    reads: Sequence[Read]
    pieces: Sequence[Piece]

    @property
    def crosses(self) -> bool:
        readers = {r.id: r.reader for r in self.reads}
        return any(readers[p.read] != p.dest for p in self.pieces)

    @property
    def relays(self) -> bool:
        readers = {r.id: r.reader for r in self.reads}
        return any(p.sender(readers[p.read]) != readers[p.read] for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def pieces_for(self, rank: int) -> list[Piece]:
        readers = {r.id: r.reader for r in self.reads}
        return [p for p in self.pieces if rank in (p.dest, p.sender(readers[p.read]))]


class Plan(Protocol):
    """What the executor runs; every rank holds the same one."""

    @property
    def targets(self) -> Sequence[Target]: ...

    @property
    def waves(self) -> Sequence[Wave]: ...

    @property
    def world(self) -> int: ...

    @property
    def bytes_total(self) -> int:
        """Bytes delivered into targets, over all ranks."""
        ...

    @property
    def tensor_count(self) -> int: ...

    @property
    def point_to_point(self) -> bool:
        """Move pieces by point-to-point sends (sparse plans: a live transfer between two
        meshes) rather than one ``all_to_all`` per wave."""
        ...
