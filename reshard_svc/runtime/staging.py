"""The stager: the one way this rank's boxes become host bytes for a background writer.

A save that returns before its bytes are written (``async_save``, a
:class:`~reshard_svc.CheckpointManager`'s persistent and fast tiers) first *stages* this
rank's boxes, so training may change its tensors at once:

* a box of CPU state, contiguous, whose writer is a forked child (``fork=True``) stays the
  live view: the child's copy-on-write memory is the snapshot (pages are copied only where
  training later writes);
* every other box is copied into a staging buffer reused from one stage to the next
  (pinned host memory for CUDA state, copied with ``non_blocking`` and synchronized before
  :meth:`Stager.stage` returns).

Who owns what: the buffers are the background writer's from :meth:`Stager.stage` until it
has finished with them and calls :meth:`Stager.release` (poisoned under
``RESHARD_DEBUG_BUFFERS=1``); the next :meth:`Stager.stage` reclaims them (a write in
between raises :class:`~reshard_svc.errors.BufferReuseError` naming the buffer). One
stage is in flight per stager at a time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

import torch

from reshard_svc.layout import Box
from reshard_svc.runtime.buffers import reclaim, release
from reshard_svc.runtime.targets import Placed

__all__ = ["Stager", "can_fork"]

logger = logging.getLogger(__name__)


def can_fork(views: Iterable[torch.Tensor]) -> bool:
    """Whether a snapshot of ``views`` may be a forked writer's copy-on-write view: CPU
    tensors on a system with ``fork`` (``RESHARD_ASYNC_FORK=0`` turns it off)."""
    return (
        hasattr(os, "fork")
        and os.environ.get("RESHARD_ASYNC_FORK", "1") != "0"
        and all(v.device.type == "cpu" for v in views)
    )


class Stager:
    """Staging buffers for one background writer, reused from one stage to the next.

    ``what`` names the writer in errors and warnings ("the async save", "the fast tier").
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._buffers: dict[tuple[str, Box], torch.Tensor] = {}
        self._pin = True  # until pinning fails once (a locked-memory limit)

    def stage(self, placed: Mapping[str, Placed], *, fork: bool) -> dict[str, Placed]:
        """This rank's tensors with each box either its live view (``fork`` and a
        contiguous CPU box: a forked writer snapshots it) or a staging buffer holding a
        copy. Buffers of boxes not staged this time are dropped."""
        out: dict[str, Placed] = {}
        used: set[tuple[str, Box]] = set()
        cuda = False
        with torch.no_grad():
            for name, live in placed.items():
                copy = Placed(name=name, dtype=live.dtype, shape=live.shape, layout=live.layout)
                for box, view in live.local.items():
                    view = view.detach()
                    if fork and view.device.type == "cpu" and view.is_contiguous():
                        copy.local[box] = view
                        continue
                    key = (name, box)
                    buf = self._buffer(key, view)
                    on_gpu = view.device.type == "cuda"
                    buf.copy_(view, non_blocking=on_gpu and buf.is_pinned())
                    cuda = cuda or on_gpu
                    copy.local[box] = buf
                    used.add(key)
                out[name] = copy
        if cuda:
            torch.cuda.synchronize()  # the copies are done before training may step
        for key in set(self._buffers) - used:
            del self._buffers[key]
        return out

    def release(self) -> None:
        """The background writer is done with the buffers (they are the stager's again)."""
        for key, buf in self._buffers.items():
            release(buf, self._name(key))

    def _buffer(self, key: tuple[str, Box], view: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is not None and buf.dtype == view.dtype and buf.shape == view.shape:
            reclaim(buf, self._name(key))
            return buf
        pin = self._pin and view.device.type == "cuda"
        try:
            buf = torch.empty(tuple(view.shape), dtype=view.dtype, pin_memory=pin)
        except RuntimeError as e:  # pinned memory is limited: pageable, with one warning
            self._pin = False
            logger.warning(
                "%s: pinning a staging buffer failed (%s): using pageable memory", self.what, e
            )
            buf = torch.empty(tuple(view.shape), dtype=view.dtype)
        self._buffers[key] = buf
        return buf

    def _name(self, key: tuple[str, Box]) -> str:
        return f"{self.what}'s staging buffer of {key[0]!r} {key[1]}"
