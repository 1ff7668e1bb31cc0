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

Who owns what: a stage's buffers are its writers' from :meth:`Stager.stage` until the
last of them calls :meth:`Staged.release` (poisoned then under
``RESHARD_DEBUG_BUFFERS=1``); the next stage reclaims them (a write in between raises
:class:`~reshard_svc.errors.BufferReuseError` naming the buffer). A stage made while the
previous one is still held gets buffers of its own, so a writer never sees its bytes
change. A manager's two tiers share one stager: a step due on both is staged once (the
second tier's :meth:`Stager.stage` with the same ``share`` key holds the same buffers),
and its buffers go back when both tiers have written it. A stage's copies are the side
stream's or the side thread's until its :meth:`Staged.finish_copies` returns; the copies
of one stage end before the next stage's start.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from reshard_svc.layout import Box
from reshard_svc.runtime.buffers import reclaim, release
from reshard_svc.runtime.targets import Placed

__all__ = ["Staged", "Stager", "can_fork"]


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


class _Set:
    """One set of staging buffers and the writers holding it."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, Box], torch.Tensor] = {}
        self.sources: dict[tuple[str, Box], tuple[int, int, tuple[int, ...]]] = {}
        self.key: object = None  # the stage it holds (``share``)
        self.holders = 0
        self.pending: Callable[[], list[str]] | None = None  # copies not yet waited for
        self.torn: list[str] = []
        self.lock = threading.Lock()

    def finish(self) -> list[str]:
        with self.lock:
            pending, self.pending = self.pending, None
            if pending is not None:
                self.torn = pending()
            return list(self.torn)


class Staged:
    """One writer's hold on a stage: its tensors (:attr:`placed`), a wait for their
    copies, and the release that gives the buffers back once this writer is done."""

    def __init__(self, stager: Stager, held: _Set, placed: dict[str, Placed]) -> None:
        self.placed = placed
        self._stager = stager
        self._set: _Set | None = held

    def finish_copies(self) -> list[str]:
        """Wait for this stage's copies; the tensors changed in place before their copy
        finished (empty: the snapshot is whole)."""
        return self._set.finish() if self._set is not None else []

    def release(self) -> None:
        """This writer is done with the buffers (once; later calls do nothing)."""
        held, self._set = self._set, None
        if held is not None:
            self._stager._release(held)


class Stager:
    """Staging buffers for background writers, reused from one stage to the next.

    ``what`` names the writers in errors and warnings ("the async save", "the fast tier").
    One stager may serve several writers (a manager's two tiers): :meth:`stage` with the
    ``share`` key of a stage still held hands out the same buffers without copying again.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._set = _Set()  # the newest stage; an older one still held lives on in its holders
        self._pin = True  # until pinning fails once (a locked-memory limit)
        self._side: ThreadPoolExecutor | None = None  # CPU copies under overlap
        self._stream: Any = None  # CUDA copies under overlap
        self._lock = threading.Lock()  # holders are counted from the writers' threads
        self._sharing: object = None  # the open :meth:`sharing` scope's key
        self._scoped: list[_Set] = []  # the stages it holds

    def stage(
        self,
        placed: Mapping[str, Placed],
        *,
        fork: bool,
        overlap: bool = False,
        share: object = None,
    ) -> Staged:
        """This rank's tensors with each box either its live view (``fork`` and a
        contiguous CPU box: a forked writer snapshots it) or a staging buffer holding a
        copy. With ``overlap`` (never with ``fork``: the child must see whole buffers) the
        copies may still be running on return: :meth:`Staged.finish_copies` waits for
        them. With ``share``, a second writer of the same save (the same key, the same
        views) holds the buffers the first one staged: each byte is copied once."""
        shared = self._shared(placed, fork, share)
        if shared is not None:
            return shared
        self._set.finish()  # the copies of the last stage end before new ones start
        with self._lock:
            if self._set.holders:  # still being written: this stage gets buffers of its own
                self._set = _Set()
            held = self._set
            # the open sharing scope holds it too, until every writer of the save has staged
            held.holders, held.key, held.torn = 1, share, []
            if share is not None and share is self._sharing:
                held.holders += 1
                self._scoped.append(held)
        used: set[tuple[str, Box]] = set()
        copies: list[tuple[str, torch.Tensor, torch.Tensor]] = []

        def fill(key: tuple[str, Box], view: torch.Tensor) -> torch.Tensor:
            buf = self._buffer(held, key, view)
            held.sources[key] = _source(view)
            copies.append((key[0], buf, view))
            used.add(key)
            return buf

        out = _boxes(placed, fork, fill)
        for key in set(held.buffers) - used:
            del held.buffers[key]
            held.sources.pop(key, None)
        if copies:
            held.pending = self._copy(copies, overlap=overlap and not fork)
            if not overlap or fork:
                held.finish()
        return Staged(self, held, out or {})

    @contextmanager
    def sharing(self) -> Iterator[object]:
        """A scope whose key, passed as ``share`` to each writer's :meth:`stage`, makes them
        hold one stage: its buffers are not given back before the scope ends, even when
        the first writer is done before the next one stages."""
        key = object()
        self._sharing = key
        try:
            yield key
        finally:
            scoped, self._scoped, self._sharing = self._scoped, [], None
            for held in scoped:
                self._release(held)

    def _shared(self, placed: Mapping[str, Placed], fork: bool, share: object) -> Staged | None:
        """A hold on the newest stage when it was made under ``share`` and still holds a
        copy of each box ``placed`` needs, from the same views; else None."""
        held = self._set
        if share is None or held.key is not share:
            return None

        def find(key: tuple[str, Box], view: torch.Tensor) -> torch.Tensor | None:
            buf = held.buffers.get(key)
            return buf if buf is not None and held.sources.get(key) == _source(view) else None

        out = _boxes(placed, fork, find)
        if out is None:
            return None
        with self._lock:
            if not held.holders:  # released meanwhile: its bytes may be poisoned
                return None
            held.holders += 1
        return Staged(self, held, out)

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
        """Wait for the copies of the newest stage (at once when they are done); the
        tensors changed in place before their copy finished (empty: the snapshot is
        whole). The first caller (the optimizer's hook, or a writer) judges."""
        return self._set.finish()

    def close(self) -> None:
        """Wait for copies in flight and stop the side thread."""
        self.finish_copies()
        if self._side is not None:
            self._side.shutdown(wait=True)
            self._side = None

    def _release(self, held: _Set) -> None:
        """A writer is done with ``held``'s buffers; the last one gives them back."""
        with self._lock:
            held.holders -= 1
            if held.holders:
                return
            held.key = None
        for key, buf in held.buffers.items():
            release(buf, self._name(key))

    def _buffer(self, held: _Set, key: tuple[str, Box], view: torch.Tensor) -> torch.Tensor:
        buf = held.buffers.get(key)
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
        held.buffers[key] = buf
        return buf

    def _name(self, key: tuple[str, Box]) -> str:
        return f"{self.what}'s staging buffer of {key[0]!r} {key[1]}"


def _boxes(
    placed: Mapping[str, Placed],
    fork: bool,
    buffer: Callable[[tuple[str, Box], torch.Tensor], torch.Tensor | None],
) -> dict[str, Placed] | None:
    """``placed`` with each box its live view (``fork`` and a contiguous CPU box: a forked
    writer snapshots it) or the buffer ``buffer`` gives for it (None: give up, None)."""
    out: dict[str, Placed] = {}
    for name, live in placed.items():
        copy = Placed(name=name, dtype=live.dtype, shape=live.shape, layout=live.layout)
        for box, view in live.local.items():
            view = view.detach()
            if fork and view.device.type == "cpu" and view.is_contiguous():
                copy.local[box] = view
                continue
            buf = buffer((name, box), view)
            if buf is None:
                return None
            copy.local[box] = buf
        out[name] = copy
    return out


def _source(view: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """What a staged copy was taken from: the view's memory, version and strides."""
    return (view.data_ptr(), view._version, tuple(view.stride()))
