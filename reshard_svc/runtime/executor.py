"""The one executor: every plan's waves on this rank — ``load``, ``convert`` and
``transfer`` alike (:mod:`reshard_svc.plan.items` is the vocabulary they share).

Every rank calls :func:`execute` with the same plan and walks the same waves, so the
collectives line up. Per wave:

1. **read and pack** — this rank's reads come from its :class:`Source` (storage: ranged,
   block-checked reads, straight into place where it can; memory: the tensors a rank
   holds), and the pieces it sends are packed into one byte buffer in plan order, each
   aligned (:func:`~reshard_svc.runtime.buffers.aligned`) so it can be viewed as any dtype. An agreement ends the step: if any
   rank failed, every rank raises, and none is left waiting in the exchange.
2. **exchange** — one ``all_to_all`` (or point-to-point sends, for a sparse plan such as a
   transfer between two meshes) through :class:`~reshard_svc.runtime.comm.Comm`.
3. **land** — every piece for this rank goes to the :class:`Destination`: taken as is
   (``take``) or copied into ``view(piece)``; its own reads' pieces first, then what it
   received, in plan order.
4. **agree** — every rank reports the wave landed (and, with ``verify``, the CRC32C of
   every piece as sent and as landed); on any failure or mismatch every rank raises.
   Only then ``dest.wave_done(wave)``: a destination may publish the wave (a transfer
   swaps it in) knowing every rank has it whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import crc32c
import torch

from reshard_svc.errors import DistributedError
from reshard_svc.plan.items import Piece, Plan, Read, Wave
from reshard_svc.runtime.buffers import Arena, aligned, tensor_bytes
from reshard_svc.runtime.comm import Comm

__all__ = ["Codec", "Destination", "Progress", "ProgressInfo", "Source", "execute"]

logger = logging.getLogger(__name__)


class Destination(Protocol):
    """Where the executor lands a plan's pieces on this rank."""

    def view(self, piece: Piece) -> torch.Tensor:
        """The CPU tensor region ``piece`` lands in (the executor copies into it, or a
        source reads straight into it from a local file)."""
        ...

    def take(self, piece: Piece, data: torch.Tensor) -> bool:
        """Keep ``data`` (``piece.box`` in the read's dtype) as it is, without a copy, and
        say True; or say False and the executor copies it into ``view(piece)``."""
        ...

    def wave_done(self, wave: Wave) -> None:
        """Every piece of ``wave`` has landed on every rank."""
        ...


class Codec(Protocol):
    """Pieces that travel encoded, at sizes known only to their sender (a weight sync's
    deltas). With a codec, every piece that crosses between ranks goes through it: the
    sizes are exchanged (one small exchange) before the data."""

    def encode(self, piece: Piece, data: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """``(encoding, payload bytes)`` for a piece this rank sends (``data``: the piece
        as read), or ``(0, None)`` to send it as it is."""
        ...

    def decode(self, piece: Piece, encoding: int, payload: torch.Tensor) -> None:
        """Land a piece this rank received (``payload``: the bytes sent; with encoding 0,
        the piece itself) into the destination the codec was made for."""
        ...

    def wave_done(self, wave: Wave) -> None:
        """Every rank has landed ``wave`` (after ``dest.wave_done``)."""
        ...

    def forwarded(self, piece: Piece, nbytes: int) -> None:
        """This rank forwarded ``piece`` (as it received it, ``nbytes`` encoded) in a
        relay round."""
        ...


class Source(Protocol):
    """Where this rank's reads come from."""

    def dtype(self, tensor: str) -> torch.dtype:
        """The dtype of a read's bytes (what ``tensor`` holds where it is read)."""
        ...

    def read(
        self, reads: Sequence[Read], pieces: Mapping[int, list[Piece]], dest: Destination
    ) -> tuple[list[torch.Tensor], set[Piece]]:
        """This rank's reads of one wave, in order, as tensors of each read's box; and the
        pieces (of ``pieces``, by read id) already put straight into ``dest``."""
        ...

    @property
    def bytes_read(self) -> int:
        """Bytes fetched from storage so far (0 from memory)."""
        ...


@dataclass(frozen=True, kw_only=True)
class ProgressInfo:
    """Reported after every wave; the same numbers on every rank."""

    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int

    def to_json(self) -> dict[str, int]:
        return {
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "tensors_done": self.tensors_done,
            "tensors_total": self.tensors_total,
        }


Progress = Callable[[ProgressInfo], None]


def _crc(t: torch.Tensor) -> int:
    return int(crc32c.crc32c(tensor_bytes(t.detach().cpu().contiguous())))


@dataclass(frozen=True, kw_only=True)
class _MyWave:
    """One wave as this rank sees it: its reads, and the pieces that cross between ranks
    (in plan order, the order of the exchange buffers on every rank)."""

    pieces: Sequence[Piece]
    readers: dict[int, Read]  # read id -> read
    mine: list[Read]  # the reads this rank performs
    pieces_of: dict[int, list[Piece]]  # read id -> its pieces, for this rank's reads
    crossing: list[Piece]  # first round: from their readers
    #: whether any piece of the wave crosses between ranks (then every rank exchanges)
    exchanges: bool
    #: second round: replicated stripes forwarded by their vias (:attr:`Piece.via`)
    relayed: list[Piece]
    #: whether any piece of the wave is forwarded (then every rank takes a second round)
    relays: bool

    @classmethod
    def of(cls, wave: Wave, me: int) -> _MyWave:
        reads = wave.reads  # built once per wave
        readers = {r.id: r for r in reads}
        # only this rank's pieces: a plan may hold one piece for every holder of a box
        pieces = wave.pieces_for(me)
        exchanges = wave.crosses
        pieces_of: dict[int, list[Piece]] = {}
        crossing, relayed = [], []
        for p in pieces:
            reader = readers[p.read].reader
            if reader == me:
                pieces_of.setdefault(p.read, []).append(p)
            if p.sender(reader) != reader:
                relayed.append(p)
            elif reader != p.dest:
                crossing.append(p)
        # segments go in (sender, dest) order; the plan's order is (reader, dest, ...)
        relayed.sort(key=lambda p: (p.via, p.dest))
        relays = wave.relays
        mine = [r for r in reads if r.reader == me]
        return cls(
            pieces=pieces,
            readers=readers,
            mine=mine,
            pieces_of=pieces_of,
            crossing=crossing,
            exchanges=exchanges,
            relayed=relayed,
            relays=relays,
        )

    def sender(self, p: Piece) -> int:
        return p.sender(self.readers[p.read].reader)

    def piece(self, bands: Mapping[int, torch.Tensor], p: Piece) -> torch.Tensor:
        """Piece ``p`` inside the band this rank read for it."""
        r = self.readers[p.read]
        return bands[r.id][p.box.slices_in(r.box)]


class _Step:
    """One wave on this rank: read and pack, exchange, land; with CRCs when verifying."""

    def __init__(
        self,
        w: _MyWave,
        plan: Plan,
        source: Source,
        comm: Comm,
        arena: Arena | None,
        codec: Codec | None = None,
    ) -> None:
        self.w, self.plan, self.source, self.comm, self.arena = w, plan, source, comm, arena
        self.codec = codec
        #: with a codec: (size << 8 | encoding) of each crossing piece, in plan order, as
        #: sent by this rank and then as received
        self.heads: list[int] = []
        self.bands: dict[int, torch.Tensor] = {}
        self.in_place: set[Piece] = set()
        self.send = self.recv = torch.empty(0, dtype=torch.uint8)
        self.send_splits = [0] * comm.world
        self.recv_splits = [0] * comm.world
        self.sent: dict[str, int] = {}  # piece key -> CRC32C, when verifying
        self.got: dict[str, int] = {}
        #: stripes this rank forwards: (read, box) -> as received in the first round
        self.forward: dict[tuple[int, Any], torch.Tensor] = {}
        #: with a codec: (read, box) -> (head, CRC32C of the decoded stripe or None)
        self.forward_heads: dict[tuple[int, Any], tuple[int, int | None]] = {}
        self.relay_round = False

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self.arena is not None:
            return self.arena.take(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def read_and_pack(self, dest: Destination, verify: bool) -> None:
        w, me = self.w, self.comm.rank
        views, self.in_place = self.source.read(w.mine, w.pieces_of, dest)
        self.bands = {r.id: v for r, v in zip(w.mine, views)}
        if not w.exchanges or self.comm.world == 1:
            return
        for p in w.crossing:
            src = w.sender(p)
            if src == me:
                self.send_splits[p.dest] += aligned(p.nbytes)
            if p.dest == me:
                self.recv_splits[src] += aligned(p.nbytes)
        if self.codec is not None:
            self._pack_encoded(self.codec, verify)
            return
        self.send = self._buffer(sum(self.send_splits))
        self.recv = self._buffer(sum(self.recv_splits))
        off = 0
        for p in w.crossing:
            if w.sender(p) != me:
                continue
            slot = self.send[off : off + p.nbytes]
            typed = slot.view(self.source.dtype(w.readers[p.read].tensor)).view(p.box.sizes)
            typed.copy_(w.piece(self.bands, p))
            if verify:
                self.sent[_key(p)] = _crc(slot)
            off += aligned(p.nbytes)

    def _pack_encoded(self, codec: Codec, verify: bool) -> None:
        """Encode this rank's crossing pieces (the codec decides each one's bytes) and pack
        them; the receivers learn the sizes in :meth:`exchange`."""
        w, me = self.w, self.comm.rank
        out: list[tuple[Piece, int, torch.Tensor | None, int]] = []
        self.send_splits = [0] * self.comm.world
        for p in w.crossing:
            if w.sender(p) != me:
                continue
            data = w.piece(self.bands, p)
            if verify:
                self.sent[_key(p)] = _crc(data)
            enc, payload = codec.encode(p, data)
            size = p.nbytes if payload is None else payload.numel()
            out.append((p, enc, payload, size))
            self.heads.append(size << 8 | enc)
            self.send_splits[p.dest] += aligned(size)
        self.send = self._buffer(sum(self.send_splits))
        off = 0
        for p, _, payload, size in out:
            slot = self.send[off : off + size]
            if payload is None:
                dtype = self.source.dtype(w.readers[p.read].tensor)
                slot.view(dtype).view(p.box.sizes).copy_(w.piece(self.bands, p))
            else:
                slot.copy_(payload)
            off += aligned(size)

    def _exchange_sizes(self) -> None:
        """Each crossing piece's encoded size and encoding, from its sender to its
        receiver (counts per pair are in the plan); then the data's receive splits. In
        the relay round: each relayed stripe's, from its via."""
        w, me, world = self.w, self.comm.rank, self.comm.world
        pieces = w.relayed if self.relay_round else w.crossing
        counts_out, counts_in = [0] * world, [0] * world
        for p in pieces:
            if w.sender(p) == me:
                counts_out[p.dest] += 8
            if p.dest == me:
                counts_in[w.sender(p)] += 8
        heads = torch.tensor(self.heads, dtype=torch.int64).view(torch.uint8)
        got = self.comm.exchange(
            heads, counts_out, counts_in, point_to_point=self.plan.point_to_point
        )
        self.heads = got.cpu().view(torch.int64).tolist() if got.numel() else []
        self.recv_splits = [0] * world
        at = 0
        for p in pieces:
            if p.dest == me:
                head = self.heads[at]
                if head < 0:
                    raise DistributedError(f"rank {w.sender(p)} sent a piece of negative size")
                self.recv_splits[w.sender(p)] += aligned(head >> 8)
                at += 1
        self.recv = self._buffer(sum(self.recv_splits))

    def exchange(self) -> None:
        if not self.w.exchanges or self.comm.world == 1:
            return
        if self.codec is not None:
            self._exchange_sizes()
        self.recv = self.comm.exchange(
            self.send,
            self.send_splits,
            self.recv_splits,
            out=self.recv,
            point_to_point=self.plan.point_to_point,
        )
        self.send = torch.empty(0, dtype=torch.uint8)

    def land(self, dest: Destination, verify: bool) -> None:
        """The first round's pieces for this rank into ``dest``: its own reads' pieces
        first (unless read in place), then what it received, in plan order; then, when
        the wave relays, the stripes it forwards packed for the second round."""
        w, me = self.w, self.comm.rank
        for p in w.pieces:
            if p.dest == me and w.readers[p.read].reader == me:
                data = w.piece(self.bands, p)
                if verify:
                    self.sent[_key(p)] = _crc(data)
                if p not in self.in_place:
                    _land(dest, p, data)
        self._land_received(dest, w.crossing, forwards=True, verify=verify)
        self.bands.clear()
        if w.relays and self.comm.world > 1:
            self._pack_relayed(verify)

    def _typed(self, raw: torch.Tensor, p: Piece) -> torch.Tensor:
        return raw.view(self.source.dtype(self.w.readers[p.read].tensor)).view(p.box.sizes)

    def _pack_relayed(self, verify: bool) -> None:
        self.relay_round = True
        if self.codec is not None:
            self._pack_relayed_encoded(self.codec, verify)
            return
        w, me = self.w, self.comm.rank
        self.send_splits = [0] * self.comm.world
        self.recv_splits = [0] * self.comm.world
        for p in w.relayed:
            if p.via == me:
                self.send_splits[p.dest] += aligned(p.nbytes)
            else:
                self.recv_splits[p.via] += aligned(p.nbytes)
        self.send = self._buffer(sum(self.send_splits))
        relay_recv = self._buffer(sum(self.recv_splits))
        off = 0
        for p in w.relayed:
            if p.via != me:
                continue
            slot = self.send[off : off + p.nbytes]
            self._typed(slot, p).copy_(self.forward[(p.read, p.box)])
            if verify:
                self.sent[_key(p)] = _crc(slot)
            off += aligned(p.nbytes)
        self.forward.clear()
        self.recv = relay_recv

    def _pack_relayed_encoded(self, codec: Codec, verify: bool) -> None:
        """The stripes this rank forwards, as it received them (encoded); their receivers
        learn the sizes in the relay round's :meth:`exchange`."""
        w, me = self.w, self.comm.rank
        self.send_splits = [0] * self.comm.world
        self.heads = []
        out = []
        for p in w.relayed:
            if p.via != me:
                continue
            key = (p.read, p.box)
            head, crc = self.forward_heads[key]
            self.heads.append(head)
            self.send_splits[p.dest] += aligned(head >> 8)
            out.append((self.forward[key], head >> 8))
            codec.forwarded(p, head >> 8)
            if verify and crc is not None:
                self.sent[_key(p)] = crc
        self.send = self._buffer(sum(self.send_splits))
        off = 0
        for payload, size in out:
            self.send[off : off + size].copy_(payload)
            off += aligned(size)
        self.forward.clear()
        self.forward_heads.clear()

    def land_relayed(self, dest: Destination) -> None:
        """The second round's stripes for this rank (after :meth:`exchange` again)."""
        if not self.w.relays or self.comm.world == 1:
            return
        self._land_received(dest, self.w.relayed, forwards=False, verify=False)

    def _land_received(
        self, dest: Destination, pieces: Sequence[Piece], *, forwards: bool, verify: bool
    ) -> None:
        """This rank's pieces of the received buffer, in plan order: decoded by the codec,
        or landed as they are; with ``forwards``, the stripes this rank relays are kept as
        received (encoded, with their head and landed CRC, under a codec)."""
        off = at = 0
        me = self.comm.rank
        for p in pieces:
            if p.dest != me:
                continue
            keep = forwards and p.via == me
            if self.codec is not None:
                head = self.heads[at]
                at += 1
                size = head >> 8
                payload = self.recv[off : off + size]
                self.codec.decode(p, head & 0xFF, payload)
                if keep:  # forwarded as received, encoded (its receivers decode it)
                    self.forward[(p.read, p.box)] = payload
                    crc = _crc(dest.view(p)) if verify else None
                    self.forward_heads[(p.read, p.box)] = (head, crc)
                off += aligned(size)
                continue
            data = self._typed(self.recv[off : off + p.nbytes], p)
            if keep:
                self.forward[(p.read, p.box)] = data
            _land(dest, p, data)
            off += aligned(p.nbytes)

    def run(
        self, dest: Destination, verify: bool, what: str, before: Callable[[], None]
    ) -> list[Any]:
        """The wave's agreements: read and pack (after ``before``), exchange (twice with
        relays), land. Returns every rank's report (sent and landed CRCs, when verifying)."""

        def read_and_pack() -> None:
            before()
            self.read_and_pack(dest, verify)

        self.comm.run_everywhere(f"{what}: reading", read_and_pack)
        self.exchange()
        if self.w.relays:  # first round landed and the stripes to forward packed, everywhere
            self.comm.run_everywhere(f"{what}: relaying", lambda: self.land(dest, verify))
            self.exchange()  # the second round

        def land() -> dict[str, Any]:
            if self.w.relays:
                self.land_relayed(dest)
            else:
                self.land(dest, verify)
            self.finish(dest, verify)
            return {"sent": self.sent, "got": self.got} if verify else {}

        _, reports = self.comm.run_everywhere(f"{what}: landing", land)
        return reports

    def finish(self, dest: Destination, verify: bool) -> None:
        self.recv = torch.empty(0, dtype=torch.uint8)
        if verify:
            for p in self.w.pieces:
                if p.dest == self.comm.rank:
                    self.got[_key(p)] = _crc(dest.view(p))


def _land(dest: Destination, p: Piece, data: torch.Tensor) -> None:
    if not dest.take(p, data):
        dest.view(p).copy_(data)


def _key(p: Piece) -> str:
    """A piece's name on every rank: read, target, destination, box (JSON-safe)."""
    return f"{p.read}:{p.target}:{p.dest}:{','.join(map(str, p.box.offsets))}:" + ",".join(
        map(str, p.box.sizes)
    )


def _check_pieces(wave: _MyWave, plan: Plan, reports: list[Any]) -> None:
    """Every piece landed with the CRC32C it was sent with (the same verdict on every rank:
    each rank reports the pieces it sent and landed, and every rank checks them all)."""
    sent: dict[str, int] = {}
    got: dict[str, int] = {}
    for r in reports:
        sent.update(r["sent"])
        got.update(r["got"])
    bad = []
    for key in sorted(set(sent) | set(got)):
        if sent.get(key) != got.get(key):
            read, target, dest, offsets, sizes = key.split(":")
            sender = wave.readers[int(read)].reader
            bad.append(
                f"{plan.targets[int(target)].tensor!r} [{offsets}]+[{sizes}] from rank {sender} "
                f"to rank {dest}: sent CRC32C {sent.get(key)}, landed {got.get(key)}"
            )
    if bad:
        raise DistributedError(
            f"verify: {len(bad)} piece(s) did not land as sent: {'; '.join(bad[:5])}"
        )


def execute(
    plan: Plan,
    source: Source,
    comm: Comm,
    dest: Destination,
    *,
    progress: Progress | None = None,
    arena: Arena | None = None,
    verify: bool = False,
    label: str = "",
    codec: Codec | None = None,
) -> int:
    """Run ``plan`` on this rank (every rank calls it); returns the bytes this rank read
    from storage.

    ``arena`` (kept by the caller between runs) provides the exchange buffers, so a plan
    run again faults in no new memory. ``verify`` compares every piece's CRC32C as sent
    and as landed before ``wave_done``. ``codec`` sends crossing pieces encoded (a relay
    forwards them as it received them). A failure anywhere raises on every rank at the
    wave's next agreement: the rank that failed re-raises its own error, the others a
    :class:`~reshard_svc.errors.DistributedError` naming it.
    """
    me = comm.rank
    total, tensors_total = plan.bytes_total, plan.tensor_count
    done = tensors_done = 0
    waves = plan.waves
    # A failure in wave_done is held until the next agreement, so every rank fails
    # together instead of leaving peers blocked in an exchange.
    pending: list[BaseException] = []

    def raise_pending() -> None:
        if pending:
            raise pending[0]

    for i, wave in enumerate(waves):
        w = _MyWave.of(wave, me)
        if arena is not None:
            arena.reset()
        step = _Step(w, plan, source, comm, arena, codec)
        reports = step.run(dest, verify, f"{label}wave {i + 1}/{len(waves)}", raise_pending)
        if verify:
            _check_pieces(w, plan, reports)
        try:
            dest.wave_done(wave)
            if codec is not None:
                codec.wave_done(wave)
        except Exception as e:  # surfaced on every rank at the next agreement
            pending.append(e)
        done += wave.nbytes  # every rank's pieces, not only this one's
        tensors_done += wave.tensors_done
        if progress is not None:
            progress(
                ProgressInfo(
                    bytes_done=done,
                    bytes_total=total,
                    tensors_done=tensors_done,
                    tensors_total=tensors_total,
                )
            )
    comm.run_everywhere(f"{label}finishing", raise_pending)
    return source.bytes_read
