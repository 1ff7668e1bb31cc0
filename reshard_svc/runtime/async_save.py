"""``async_save``: stage the state, return a future, write and commit in the background.

Order of events, on every rank:

1. wait for this rank's previous save if ``max_in_flight`` are already running;
2. agree on the state dict and plan the files (small collectives on a dedicated gloo
   group, so the background thread never shares a process group with training);
3. copy only the boxes this rank will write into staging buffers (pinned host memory for
   CUDA tensors; buffers are reused from one save to the next) — this is the blocking part;
4. return a :class:`~concurrent.futures.Future`; a background thread writes the files and
   rank 0 commits the index last. Errors surface from ``future.result()``.

After ``async_save`` returns, training may change its tensors freely: the checkpoint holds
the values at call time.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from reshard_svc.index import CheckpointIndex
from reshard_svc.layout import Box
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.save import prepare_save, write_and_commit
from reshard_svc.storage import open_storage

__all__ = ["AsyncSaver", "async_save"]

logger = logging.getLogger(__name__)


class AsyncSaver:
    """Background saves for one process group. Create it on every rank (collective)."""

    def __init__(self, process_group: Any = None, max_in_flight: int = 1) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        if dist.is_available() and dist.is_initialized():
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            # Collectives of background saves must never interleave with training's.
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        else:
            self._group = None
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="reshard-async-save")
        self._inflight: deque[Future[CheckpointIndex]] = deque()
        self._buffers: dict[tuple[str, Box], torch.Tensor] = {}
        self._lock = threading.Lock()

    def save(
        self,
        state_dict: Mapping[str, Any],
        uri: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
    ) -> Future[CheckpointIndex]:
        """Stage ``state_dict`` and return a future of the committed index."""
        while len(self._inflight) >= self.max_in_flight:
            done = self._inflight.popleft()
            try:
                done.result()
            except Exception:  # the caller sees it from that save's own future
                logger.debug("previous async save failed", exc_info=True)
        comm = Comm(self._group)
        prep = prepare_save(state_dict, uri, comm, open_storage(uri, storage_options))
        reuse = self.max_in_flight == 1  # buffers are free: the previous save is done
        mine = {(name, box) for spec in prep.plan.files_of(comm.rank) for name, box in spec.entries}
        staged_bufs: dict[tuple[str, Box], torch.Tensor] = {}
        with torch.no_grad():
            for name, placed in prep.placed.items():
                for box in list(placed.local):
                    if (name, box) not in mine:
                        del placed.local[box]  # another rank writes it; nothing to keep
                        continue
                    view = placed.local[box]
                    buf = self._buffers.get((name, box)) if reuse else None
                    if buf is None or buf.shape != view.shape or buf.dtype != view.dtype:
                        buf = torch.empty(
                            view.shape, dtype=view.dtype, pin_memory=view.device.type == "cuda"
                        )
                    buf.copy_(view, non_blocking=view.device.type == "cuda")
                    placed.local[box] = buf
                    staged_bufs[(name, box)] = buf
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        if reuse:
            self._buffers = staged_bufs
        future = self._pool.submit(write_and_commit, prep, comm)
        self._inflight.append(future)
        return future

    def wait(self) -> None:
        """Block until every save this saver started has finished (errors re-raised)."""
        while self._inflight:
            self._inflight.popleft().result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None


_SAVERS: dict[Any, AsyncSaver] = {}


def async_save(
    state_dict: Mapping[str, Any],
    uri: str,
    *,
    process_group: Any = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Future[CheckpointIndex]:
    """Like :func:`reshard_svc.save`, but returns once the state is staged.

    Called by every rank. At most one save per process group is in flight: a second call
    waits for the first. The first call creates a dedicated gloo group (collective).
    """
    key = process_group
    saver = _SAVERS.get(key)
    if saver is None:
        saver = _SAVERS[key] = AsyncSaver(process_group)
    return saver.save(state_dict, uri, storage_options=storage_options)
