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

With ``overlap=True`` (a manager given ``optimizers=``) :meth:`Stager.stage` returns once
the copies are *queued*: on a side CUDA stream for CUDA state, on the stager's own thread
(``reshard-stage``) for CPU state, so they run beside the next forward and backward. The
optimizer's step pre-hook calls :meth:`Stager.finish_copies` first; the background writer
calls it before it reads a byte.

A torn snapshot is never written: :meth:`Stager.finish_copies` returns the tensors whose
``_version`` changed (an in-place update: ``optimizer.step``, ``add_``) between ``stage``
and the end of their copies, and the writer then fails the save with
:class:`~reshard_svc.errors.TornSnapshotError` naming them (the manager makes that step not
count, with one warning). Where the copies end inside ``stage`` (the default) or a forked
child is the snapshot, nothing can change in between.

Who owns what: the buffers are the background writer's from :meth:`Stager.stage` until it
has finished with them and calls :meth:`Stager.release` (poisoned under
``RESHARD_DEBUG_BUFFERS=1``); the next :meth:`Stager.stage` reclaims them (a write in
between raises :class:`~reshard_svc.errors.BufferReuseError` naming the buffer). One
stage is in flight per stager at a time; its copies are the side stream's or the side
thread's until :meth:`Stager.finish_copies` returns.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch

from reshard_svc.layout import Box
from reshard_svc.runtime.buffers import reclaim, release
from reshard_svc.runtime.targets import Placed

__all__ = ["Stager", "can_fork"]


def _copy_then(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], torn: Callable[[], list[str]]
) -> list[str]:
    """Copy each view into its buffer, then name the tensors changed meanwhile."""
    with torch.no_grad():
        for buf, view in pairs:
            buf.copy_(view)
    return torn()


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
        self._side: ThreadPoolExecutor | None = None  # CPU copies under overlap
        self._stream: Any = None  # CUDA copies under overlap
        self._pending: Callable[[], list[str]] | None = None  # copies not yet waited for
        self._torn: list[str] = []
        self._lock = threading.Lock()

    def stage(
        self, placed: Mapping[str, Placed], *, fork: bool, overlap: bool = False
    ) -> dict[str, Placed]:
        """This rank's tensors with each box either its live view (``fork`` and a
        contiguous CPU box: a forked writer snapshots it) or a staging buffer holding a
        copy. Buffers of boxes not staged this time are dropped. With ``overlap`` (never
        with ``fork``: the child must see whole buffers) the copies may still be running
        on return: :meth:`finish_copies` waits for them."""
        self.finish_copies()  # a stage not yet waited for (its save failed early)
        out: dict[str, Placed] = {}
        used: set[tuple[str, Box]] = set()
        copies: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for name, live in placed.items():
            copy = Placed(name=name, dtype=live.dtype, shape=live.shape, layout=live.layout)
            for box, view in live.local.items():
                view = view.detach()
                if fork and view.device.type == "cpu" and view.is_contiguous():
                    copy.local[box] = view
                    continue
                key = (name, box)
                buf = self._buffer(key, view)
                copies.append((name, buf, view))
                copy.local[box] = buf
                used.add(key)
            out[name] = copy
        for key in set(self._buffers) - used:
            del self._buffers[key]
        self._torn = []
        if copies:
            self._pending = self._copy(copies, overlap=overlap and not fork)
            if not overlap or fork:
                self.finish_copies()
        return out

    def _copy(
        self, copies: list[tuple[str, torch.Tensor, torch.Tensor]], *, overlap: bool
    ) -> Callable[[], list[str]]:
        """Start the copies; returns what waits for them and names the tensors changed in
        place since they were queued (each tensor's ``_version`` read now, and again
        right after its copy)."""
        versions = [(name, view, view._version) for name, _, view in copies]

        def torn() -> list[str]:
            return sorted({n for n, view, v in versions if view._version != v})

        gpu = [(b, v) for _, b, v in copies if v.device.type == "cuda"]
        cpu = [(b, v) for _, b, v in copies if v.device.type != "cuda"]
        done_cpu: Future[list[str]] | None = None
        if cpu and overlap:
            if self._side is None:
                self._side = ThreadPoolExecutor(1, thread_name_prefix="reshard-stage")
            done_cpu = self._side.submit(_copy_then, cpu, torn)
        elif cpu:
            _copy_then(cpu, torn)
        event = None
        if gpu:
            stream = None
            if overlap:
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                stream = self._stream
                stream.wait_stream(torch.cuda.current_stream())  # the values as of now
            with torch.no_grad(), torch.cuda.stream(stream) if stream else nullcontext():
                for buf, view in gpu:
                    buf.copy_(view, non_blocking=buf.is_pinned())
                    if stream is not None:
                        view.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)

        def wait() -> list[str]:
            changed = done_cpu.result() if done_cpu is not None else []
            if event is not None:
                event.synchronize()
                changed = sorted({*changed, *torn()})
            return changed

        return wait

    def finish_copies(self) -> list[str]:
        """Wait for the copies of the last :meth:`stage` (at once when they are done);
        the tensors changed in place before their copy finished (empty: the snapshot is
        whole). The first caller (the optimizer's hook, or the writer) judges."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is not None:
                self._torn = pending()
            return list(self._torn)

    def close(self) -> None:
        """Wait for copies in flight and stop the side thread."""
        self.finish_copies()
        if self._side is not None:
            self._side.shutdown(wait=True)
            self._side = None

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
