"""Collectives the runtime needs, over one process group, with nothing pickled.

Metadata travels as JSON bytes in uint8 tensors; data travels with ``all_to_all_single``
or, for sparse plans, point-to-point sends (``batch_isend_irecv``).
Buffers live on CUDA when the group's backend is NCCL and on the CPU otherwise (gloo), so
the same code runs on both. Without an initialised process group, a :class:`Comm` is a
world of one and every collective is a local no-op.

A :class:`Channel` is one more thread's way onto a gloo group that another thread already
drives with collectives (a checkpoint manager's one group: the caller's thread agrees on
it, each tier's background thread on its own channel). Collectives would need every rank
to issue them in one order across the threads; a channel's messages are point-to-point,
tagged by channel and by how many messages went that way before, so gloo matches each with
its own and the threads never wait on each other's order.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from reshard_svc.errors import DistributedError

__all__ = ["Channel", "Comm"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Comm:
    """A process group seen by one rank. Every method is called by every rank, in order."""

    #: every :meth:`exchange` goes point to point (a :class:`Channel`: no collectives)
    POINT_TO_POINT_ONLY = False

    def __init__(self, process_group: Any = None) -> None:
        self.group = process_group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(process_group)
            self.world = dist.get_world_size(process_group)
            backend = str(dist.get_backend(process_group)).lower()
            self.device = (
                torch.device("cuda", torch.cuda.current_device())
                if "nccl" in backend and torch.cuda.is_available()
                else torch.device("cpu")
            )
            self.distributed = True
        else:
            self.rank, self.world, self.device, self.distributed = 0, 1, torch.device("cpu"), False
        self._channels = 0

    def channel(self, what: str) -> Channel:
        """A new :class:`Channel` on this group for one other thread (``what`` drives
        it). Every rank opens its channels in the same order."""
        self._channels += 1
        return Channel(self, self._channels, what)

    # ---- metadata

    def all_gather_json(self, obj: Any) -> list[Any]:
        raw = json.dumps(obj).encode()
        if not self.distributed or self.world == 1:
            return [json.loads(raw)]
        n = torch.tensor([len(raw)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n, group=self.group)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        if raw:
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        outs = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(outs, buf, group=self.group)
        return [
            json.loads(bytes(o[: int(s.item())].cpu().numpy().tobytes()))
            for o, s in zip(outs, sizes)
        ]

    def run_everywhere(
        self, what: str, fn: Callable[[], T], share: Callable[[T], Any] | None = None
    ) -> tuple[T, list[Any]]:
        """Run ``fn`` on every rank; if any rank fails, every rank raises.

        The failing rank re-raises its own exception; the others raise DistributedError
        naming the failed ranks and their messages (as text — nothing is pickled).
        Returns this rank's result and every rank's shared value: ``share(result)``, or the
        result itself when it is JSON-able (else None).
        """
        err: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as e:  # collected, then re-raised below on every rank
            err = e
        payload = {"error": f"{type(err).__name__}: {err}" if err else None}
        if err is None:
            shared = share(result) if share is not None else result
            payload["result"] = shared if _jsonable(shared) else None
        gathered = self.all_gather_json(payload)
        failures = {i: g["error"] for i, g in enumerate(gathered) if g["error"]}
        if err is not None:
            raise err
        if failures:
            text = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
            raise DistributedError(f"{what} failed on {len(failures)} rank(s): {text}", failures)
        return result, [g.get("result") for g in gathered]

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` (int64s) over every rank."""
        if not self.distributed or self.world == 1:
            return [int(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    # ---- data

    def exchange(
        self,
        send: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        *,
        out: torch.Tensor | None = None,
        point_to_point: bool = False,
    ) -> torch.Tensor:
        """Exchange uint8 buffers: ``send_splits[d]`` bytes to rank d, ``recv_splits[s]``
        bytes from rank s, received into ``out`` (or a new buffer), segments in rank order.

        ``point_to_point`` sends only to the ranks a segment is for (``batch_isend_irecv``):
        for sparse exchanges, such as a transfer between two meshes, where most pairs of
        ranks have nothing to say; otherwise one ``all_to_all_single``.
        """
        total = int(sum(recv_splits))
        if not self.distributed or self.world == 1:
            return send
        recv = out if out is not None else torch.empty(total, dtype=torch.uint8)
        if recv.device != self.device:
            recv = torch.empty(total, dtype=torch.uint8, device=self.device)
        if send.device != self.device:
            send = send.to(self.device)
        if point_to_point or self.POINT_TO_POINT_ONLY:
            self._point_to_point(send, send_splits, recv, recv_splits)
        else:
            dist.all_to_all_single(
                recv,
                send,
                list(map(int, recv_splits)),
                list(map(int, send_splits)),
                group=self.group,
            )
        return recv

    def _point_to_point(
        self,
        send: torch.Tensor,
        send_splits: Sequence[int],
        recv: torch.Tensor,
        recv_splits: Sequence[int],
    ) -> None:
        segments: list[dict[int, torch.Tensor]] = [{}, {}]
        for buf, splits, out in (
            (send, send_splits, segments[0]),
            (recv, recv_splits, segments[1]),
        ):
            at = 0
            for peer, n in enumerate(splits):
                if n:
                    out[peer] = buf[at : at + n]
                at += n
        self.swap(*segments)

    def swap(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        """Send ``sends[r]`` to rank ``r`` and receive each ``recvs[s]`` whole from rank
        ``s`` (ranks of this group), in one batch; returns when all are done. Only the
        ranks named take part (point to point): every torch.distributed point-to-point call
        of the package is made here."""
        ops = [dist.P2POp(dist.isend, t, self._global(r), self.group) for r, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, self._global(r), self.group) for r, t in recvs.items()]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


class Channel(Comm):
    """One thread's agreements and swaps on a group that other threads use too: the same
    methods as :class:`Comm`, carried by tagged point-to-point messages (gather to rank 0,
    then back). Only for gloo (NCCL has no tags); one thread drives each channel, and every
    rank calls its methods in the same order, as with :class:`Comm`."""

    #: a tag is the channel's number over this many bits of message count (a gloo tag is
    #: a non-negative int32)
    COUNT_BITS = 24
    POINT_TO_POINT_ONLY = True

    def __init__(self, comm: Comm, number: int, what: str) -> None:
        self.group, self.rank, self.world = comm.group, comm.rank, comm.world
        self.device, self.distributed = comm.device, comm.distributed
        self._channels = 0
        if self.distributed and self.device.type != "cpu":
            raise DistributedError(f"{what}: a channel needs a gloo group (tagged messages)")
        if number >= 1 << (31 - self.COUNT_BITS):
            raise DistributedError(f"{what}: too many channels on one group ({number})")
        self.what = what
        self._base = number << self.COUNT_BITS
        self._sent: dict[int, int] = {}  # peer -> messages sent to it on this channel
        self._received: dict[int, int] = {}

    def channel(self, what: str) -> Channel:
        raise DistributedError(f"{what}: open channels on the group's Comm, not on a channel")

    def _tag(self, counts: dict[int, int], peer: int) -> int:
        n = counts.get(peer, 0)
        counts[peer] = (n + 1) % (1 << self.COUNT_BITS)
        return self._base | n

    def _send(self, peer: int, t: torch.Tensor) -> Any:
        return dist.isend(t, group=self.group, group_dst=peer, tag=self._tag(self._sent, peer))

    def _recv(self, peer: int, t: torch.Tensor) -> Any:
        return dist.irecv(t, group=self.group, group_src=peer, tag=self._tag(self._received, peer))

    def _send_bytes(self, peer: int, raw: bytes) -> None:
        n = torch.tensor([len(raw)], dtype=torch.int64)
        works = [self._send(peer, n)]
        if raw:
            works.append(self._send(peer, torch.frombuffer(bytearray(raw), dtype=torch.uint8)))
        for w in works:
            w.wait()

    def _recv_bytes(self, peer: int) -> bytes:
        n = torch.zeros(1, dtype=torch.int64)
        self._recv(peer, n).wait()
        if not int(n):
            return b""
        buf = torch.empty(int(n), dtype=torch.uint8)
        self._recv(peer, buf).wait()
        return bytes(buf.numpy().tobytes())

    def all_gather_json(self, obj: Any) -> list[Any]:
        raw = json.dumps(obj).encode()
        if not self.distributed or self.world == 1:
            return [json.loads(raw)]
        if self.rank == 0:
            whole = b"[" + b",".join([raw, *(self._recv_bytes(r) for r in range(1, self.world))])
            whole += b"]"
            for r in range(1, self.world):
                self._send_bytes(r, whole)
        else:
            self._send_bytes(0, raw)
            whole = self._recv_bytes(0)
        return list(json.loads(whole))

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        every = self.all_gather_json([int(v) for v in values])
        return [max(column) for column in zip(*every)] if every else []

    def swap(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        """As :meth:`Comm.swap`; what this rank sends itself is copied (gloo has no pair
        to itself)."""
        me = self.rank
        if me in sends or me in recvs:
            recvs[me].copy_(sends[me])
        works = [self._send(r, t) for r, t in sends.items() if r != me]
        works += [self._recv(r, t) for r, t in recvs.items() if r != me]
        for w in works:
            w.wait()


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
    except (TypeError, ValueError):
        return False
    return True
