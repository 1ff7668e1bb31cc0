"""The pinned ring: how device bands become host bytes for a writer or a checksum.

A bounded ring of host slots (pinned where the host allows), allocated once per process
and reused: a synchronous save copies each device band into a slot on a side CUDA stream
while the writers sum and write the others; a replicated box held on a device is summed
through it too. No device bytes reach the host through pageable memory.

Who owns what: a slot is its taker's from :meth:`PinnedRing.pieces` until
:meth:`RingSlot.release` (a writer: once its bytes are written, on an error too; a
checksum: once summed); a save's writing holds :meth:`PinnedRing.session`, whose end frees
every slot.
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
RING_SLOTS = 4
RING_SLOT_BYTES = 64 * 1024 * 1024


class RingSlot:
    """One host buffer of the ring: the writer's from :meth:`PinnedRing.pieces` until it
    calls :meth:`release` (after its bytes are written)."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.free = threading.Event()
        self.free.set()

    def release(self) -> None:
        self.free.set()


class PinnedRing:
    """A bounded ring of host buffers (pinned when the host allows; pageable slots, with
    one warning, when pinning fails) through which a save moves device bands to the
    writers: the copy into one slot (on a side CUDA stream) runs while the writers sum and
    write the others. Never grows with the model; one save uses it at a time
    (:meth:`session`)."""

    def __init__(self, slots: int = RING_SLOTS, slot_bytes: int = RING_SLOT_BYTES) -> None:
        self.slot_bytes = slot_bytes
        self.pinned = True
        self.slots: list[RingSlot] = []
        for _ in range(slots):
            try:
                buf = torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=self.pinned)
            except RuntimeError as e:  # a locked-memory limit, a host full of pinned pools
                if self.pinned:
                    logger.warning("the save's pinned ring: pinning failed (%s): pageable", e)
                self.pinned = False
                buf = torch.empty(slot_bytes, dtype=torch.uint8)
            self.slots.append(RingSlot(buf))
        self._next = 0
        self._turn = threading.Lock()  # which slot is next
        self._stream: Any = None
        self._session = threading.Lock()

    def session(self) -> Any:
        """Hold the ring for one rank's writing; on leaving, every slot is free again (the
        writers have been waited for: a failed save leaves no slot taken)."""
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

    def pieces(self, band: torch.Tensor) -> Iterator[tuple[memoryview, RingSlot]]:
        """``band``'s bytes slot by slot: yields (its bytes, the slot holding them); the
        consumer releases each slot once they are written. A slot is reused only when
        free."""
        # a strided band (a column slice's rows) is packed where it lives first: its bytes,
        # not its storage's, and a 0-dim one becomes one element
        flat = band.detach().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), self.slot_bytes):
            with self._turn:
                slot = self.slots[self._next]
                self._next = (self._next + 1) % len(self.slots)
            slot.free.wait()
            slot.free.clear()
            n = min(self.slot_bytes, flat.numel() - start)
            dst = slot.buf[:n]
            if flat.device.type == "cuda":
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=flat.device)
                self._stream.wait_stream(torch.cuda.current_stream(flat.device))
                with torch.cuda.stream(self._stream):
                    dst.copy_(flat[start : start + n], non_blocking=self.pinned)
                self._stream.synchronize()
            else:
                dst.copy_(flat[start : start + n])
            yield tensor_bytes(dst), slot


_RING: PinnedRing | None = None
_RING_LOCK = threading.Lock()


def pinned_ring() -> PinnedRing:
    """This process's ring, allocated on first use."""
    global _RING
    with _RING_LOCK:
        if _RING is None:
            _RING = PinnedRing()
        return _RING
