"""The pinned ring: how device bytes and host bytes meet, for a writer, a checksum or a
reader.

A bounded ring of host slots (pinned where the host allows), allocated once per process
and reused: a synchronous save copies each device band into a slot on a side CUDA stream
while the writers sum and write the others; a replicated box held on a device is summed
through it too; a load into device tensors reads and checks file bytes into slots on the
reading pool's threads, each copying its slot to the device on its own side stream. No
device bytes move through pageable memory.

Who owns what: a slot is its taker's from :meth:`PinnedRing.take` (or
:meth:`PinnedRing.pieces`) until :meth:`RingSlot.release` (a writer: once its bytes are
written, on an error too; a checksum: once summed; a reader: once its copy to the device
is done); a save's writing or a load's reading holds :meth:`PinnedRing.session`, whose end
frees every slot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from reshard_svc.runtime.buffers import tensor_bytes

__all__ = ["RING_SLOTS", "RING_SLOT_BYTES", "PinnedRing", "RingSlot", "pinned_ring"]

logger = logging.getLogger(__name__)

#: Slots of the ring, each :data:`RING_SLOT_BYTES`: the write queue's share of host memory
#: (:data:`~reshard_svc.runtime.save.WRITE_QUEUE_BYTES`), pinned, allocated once per process.
#: A slot holds one writer's task (:data:`~reshard_svc.runtime.io_pool.TASK`), so every lane
#: of the pool has bytes to write and sum while the side stream fills the next slots.
RING_SLOTS = 32
RING_SLOT_BYTES = 8 * 1024 * 1024


class RingSlot:
    """One host buffer of the ring: its taker's from :meth:`PinnedRing.take` (or
    :meth:`PinnedRing.pieces`) until it calls :meth:`release` (after its bytes are
    written, summed or copied to the device)."""

    def __init__(self, buf: torch.Tensor, ring: PinnedRing) -> None:
        self.buf = buf
        self.free = threading.Event()
        self.free.set()
        self._ring = ring
        self._copied: Any = None  # the CUDA event of a copy into the slot not yet waited for

    def wait(self) -> None:
        """Return once the slot's bytes are there (a deferred copy from the device done)."""
        copied, self._copied = self._copied, None
        if copied is not None:
            copied.synchronize()

    def release(self) -> None:
        """Free the slot; a copy into it still in flight (a save that failed before its
        lane waited) is waited for first, so no copy writes into a slot taken again."""
        self.wait()
        with self._ring._changed:
            self.free.set()
            self._ring._changed.notify()


class PinnedRing:
    """A bounded ring of host buffers (pinned when the host allows; pageable slots, with
    one warning, when pinning fails) through which device bands reach the writers and the
    reading pool's bytes reach the device: the copy of one slot (on a side CUDA stream)
    runs while the pool's threads sum and write (or read and check) the others. Never
    grows with the model; one save or load uses it at a time (:meth:`session`)."""

    def __init__(self, slots: int = RING_SLOTS, slot_bytes: int = RING_SLOT_BYTES) -> None:
        self.slot_bytes = slot_bytes
        self.pinned = True
        try:  # one allocation: pinning is slow per call
            whole = torch.empty(slots * slot_bytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:  # a locked-memory limit, a host full of pinned pools
            logger.warning("the pinned ring: pinning failed (%s): pageable", e)
            self.pinned = False
            whole = torch.empty(slots * slot_bytes, dtype=torch.uint8)
        self._changed = threading.Condition()  # a slot was released
        self.slots = [
            RingSlot(whole[i * slot_bytes : (i + 1) * slot_bytes], self) for i in range(slots)
        ]
        self._streams = threading.local()  # each thread's side stream
        self._session = threading.Lock()

    def session(self) -> Any:
        """Hold the ring for one rank's writing (or reading); on leaving, every slot is
        free again (the pool's threads have been waited for: a failed save leaves no slot
        taken)."""
        ring = self

        class _Session:
            def __enter__(self) -> PinnedRing:
                ring._session.acquire()
                return ring

            def __exit__(self, *exc: object) -> None:
                for slot in ring.slots:
                    slot.release()
                ring._session.release()

        return _Session()

    def take(self) -> RingSlot:
        """A free slot, waiting for one to be released when none is."""
        with self._changed:
            while True:
                for slot in self.slots:
                    if slot.free.is_set():
                        slot.free.clear()
                        return slot
                self._changed.wait()

    def stream(self, device: torch.device) -> Any:
        """This thread's side CUDA stream on ``device``, made on first use, ordered after
        the work already queued on the current stream."""
        streams: dict[Any, Any] = self._streams.__dict__.setdefault("by_device", {})
        side = streams.get(device)
        if side is None:
            side = streams[device] = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        return side

    def pieces(
        self, band: torch.Tensor, *, deferred: bool = False
    ) -> Iterator[tuple[memoryview, RingSlot]]:
        """``band``'s bytes slot by slot: yields (its bytes, the slot holding them); the
        consumer releases each slot once they are written. A slot is reused only when
        free. ``deferred``: the copy from the device is only queued; whoever reads the
        bytes calls :meth:`RingSlot.wait` first (the pool's lane does, so the producer
        never waits on a copy)."""
        # a strided band (a column slice's rows) is packed where it lives first: its bytes,
        # not its storage's, and a 0-dim one becomes one element
        flat = band.detach().contiguous().reshape(-1).view(torch.uint8)
        side = self.stream(flat.device) if flat.device.type == "cuda" else None
        for start in range(0, flat.numel(), self.slot_bytes):
            slot = self.take()
            n = min(self.slot_bytes, flat.numel() - start)
            dst = slot.buf[:n]
            if side is not None:
                with torch.cuda.stream(side):
                    dst.copy_(flat[start : start + n], non_blocking=self.pinned)
                    slot._copied = torch.cuda.Event()
                    slot._copied.record(side)
                if not deferred:
                    slot.wait()
            else:
                dst.copy_(flat[start : start + n])
            yield tensor_bytes(dst), slot

    def to_device(self, slot: RingSlot, start: int, dst: torch.Tensor) -> None:
        """Copy the slot's bytes from ``start`` into ``dst`` (a contiguous uint8 device
        view) on this thread's side stream; returns once the copy is done, so the slot can
        be reused and every stream sees the bytes."""
        src = slot.buf[start : start + dst.numel()]
        if dst.device.type != "cuda":
            dst.copy_(src)
            return
        side = self.stream(dst.device)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=self.pinned)
        side.synchronize()


_RING: PinnedRing | None = None
_RING_LOCK = threading.Lock()


def pinned_ring() -> PinnedRing:
    """This process's ring, allocated on first use."""
    global _RING
    with _RING_LOCK:
        if _RING is None:
            _RING = PinnedRing()
        return _RING
