"""``async_save``: snapshot the state, return a future, write and commit in the background.

Order of events, on every rank:

1. wait for this rank's previous save if ``max_in_flight`` are already running;
2. agree on the state dict and plan the files (small collectives on the caller's process
   group, from the caller's thread, as a synchronous save does);
3. snapshot the boxes this rank will write — the blocking part:

   * CPU tensors (Linux): ``fork()`` a writer process. Its copy-on-write view of memory
     *is* the snapshot; pages are copied only where training later writes. The writer
     touches no process group and runs no torch kernels (contiguous views only);
   * CUDA tensors, non-contiguous views, or ``RESHARD_ASYNC_FORK=0``: copy into staging
     buffers (pinned host memory for CUDA), reused from one save to the next;
4. return a :class:`~concurrent.futures.Future`; the saver's one background thread
   collects the files' checksums and rank 0 commits the index last, on the saver's own
   gloo group (a manager's saver: on a channel of the manager's group). Errors while
   writing surface from ``future.result()``; a target that cannot be written (or exists
   without ``overwrite``) raises at the call, before anything is staged.

After ``async_save`` returns, training may change its tensors freely: the checkpoint holds
the values at call time.

Who owns what: each process group is driven by one thread (the caller's group by the
caller's thread; the saver's group by its background thread, one save after another).
The staging buffers (:class:`~reshard_svc.runtime.staging.Stager`) are the background
save's from staging until that save has finished (committed or failed), then the
stager's again (shared with a manager's fast tier: once both have written the step). A forked writer's copy-on-write view is the child's until the
background thread has collected it.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import torch.distributed as dist

from reshard_svc._process import fork_call
from reshard_svc.errors import TornSnapshotError, UsageError
from reshard_svc.format.checksums import check_algorithm
from reshard_svc.format.index import CheckpointIndex
from reshard_svc.plan.budget import io_threads as count_io_threads
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.save import PreparedSave, prepare_save, write_and_commit, write_files
from reshard_svc.runtime.staging import Staged, Stager, can_fork
from reshard_svc.runtime.targets import replica_crcs
from reshard_svc.storage import open_storage

__all__ = ["STOP_SIGNALS", "AsyncSaver", "async_save", "can_fork"]

logger = logging.getLogger(__name__)

#: What a job is stopped with (torchrun, Slurm, a person): a forked writer leaves them to
#: its trainer and finishes its files.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class AsyncSaver:
    """Background saves for one process group. Create it on every rank (collective).

    ``stager``: staging shared with another writer (a manager's fast tier); by default the
    saver's own. ``comm``: a gloo group's :class:`Comm` that the caller's thread drives (a
    manager's): the saver plans on it and agrees in the background on a channel of it;
    by default it plans on ``process_group`` and makes a gloo group of its own."""

    def __init__(
        self,
        process_group: Any = None,
        max_in_flight: int = 1,
        io_threads: int | str | None = None,
        stager: Stager | None = None,
        comm: Comm | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise UsageError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        #: each rank's checking writers (None: ``RESHARD_IO_THREADS``, else from the host)
        self.io_threads = None if io_threads is None else count_io_threads(io_threads)
        self._group = None  # a gloo group of its own, when no ``comm`` is given
        self._back: Comm  # driven by the one background thread alone
        if comm is not None:
            self._front, self._back = comm, comm.channel("an async save's background thread")
        else:
            self._front = Comm(process_group)  # the caller's thread: planning, staging
            if dist.is_available() and dist.is_initialized():
                pg = process_group
                ranks = None if pg is None else dist.get_process_group_ranks(pg)
                # Collectives of background saves must never interleave with training's.
                self._group = dist.new_group(ranks=ranks, backend="gloo")
            self._back = Comm(self._group)
        # one thread: saves in flight finish (and commit) one after another, in order
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="reshard-async-save")
        self._inflight: deque[Future[CheckpointIndex]] = deque()
        self._own_stager = stager is None
        self._stager = stager if stager is not None else Stager("the async save")
        self._lock = threading.Lock()

    def save(
        self,
        state_dict: Mapping[str, Any],
        uri: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        checksum: str = "crc32c",
        overwrite: bool = False,
        check_replicas: bool = True,
        overlap: bool = False,
        share: object = None,
    ) -> Future[CheckpointIndex]:
        """Stage ``state_dict`` and return a future of the committed index (arguments as
        :func:`reshard_svc.save`). With ``overlap`` it returns once the copies are queued
        (see :mod:`reshard_svc.runtime.staging`): call :meth:`finish_copies` before the
        tensors change in place, or the save fails with
        :class:`~reshard_svc.errors.TornSnapshotError`. ``share``: the stage of another
        writer of the same state under this key is held, not copied again."""
        algorithm = check_algorithm(checksum)
        while len(self._inflight) >= self.max_in_flight:
            done = self._inflight.popleft()
            try:
                done.result()
            except Exception:  # the caller sees it from that save's own future
                logger.debug("previous async save failed", exc_info=True)
        comm = self._front
        storage = open_storage(uri, storage_options)
        prep = prepare_save(
            state_dict, uri, comm, storage, algorithm, overwrite, check_replicas, self.io_threads
        )
        mine = {(name, box) for spec in prep.plan.files_of(comm.rank) for name, box in spec.entries}
        use_fork = can_fork(v for p in prep.placed.values() for v in p.local.values())
        if not use_fork:
            # Replicas this rank holds but does not write are checked now (a copy would
            # cost more); a forked writer checks them from its copy-on-write view.
            held_only = {
                n: [b for b in bs if (n, b) not in mine] for n, bs in prep.replicas.items()
            }
            prep.early_crcs = replica_crcs(prep.placed, held_only)
        keep = mine | (
            {(n, b) for n, bs in prep.replicas.items() for b in bs} if use_fork else set()
        )
        for name, placed in prep.placed.items():
            for box in [b for b in placed.local if (name, b) not in keep]:
                del placed.local[box]  # another rank writes it; nothing to keep
        # a stage made while an earlier save still holds its buffers gets its own
        staged = self._stager.stage(prep.placed, fork=use_fork, overlap=overlap, share=share)
        prep.placed = staged.placed
        written = self._fork_writer(prep, comm.rank) if use_fork else None
        future = self._pool.submit(self._write, prep, written, staged)
        self._inflight.append(future)
        return future

    def _write(
        self,
        prep: PreparedSave,
        written: Callable[[], dict[str, Any]] | None,
        staged: Staged,
    ) -> CheckpointIndex:
        """The background thread: once the copies are done and whole, write (or collect
        the forked writer), agree, commit; then the staging buffers are the stager's
        again."""

        def write_here() -> dict[str, Any]:
            torn = staged.finish_copies()
            if torn:
                raise TornSnapshotError(
                    f"{', '.join(repr(t) for t in torn[:5])} changed in place before "
                    f"{self._stager.what}'s copy finished: nothing of {prep.uri} was written "
                    "(wait for the copies before optimizer.step)",
                    torn,
                )
            return written() if written is not None else write_files(prep, self._back.rank)

        try:
            return write_and_commit(prep, self._back, write_here)
        finally:
            staged.release()

    def finish_copies(self) -> list[str]:
        """Wait for the copies of the last save (see :meth:`Stager.finish_copies`)."""
        return self._stager.finish_copies()

    def _fork_writer(self, prep: PreparedSave, rank: int) -> Callable[[], dict[str, Any]]:
        """Fork a process that writes this rank's files from the copy-on-write snapshot.

        Returns a function (run by the background thread) that waits for the writer and
        yields its [[name, size, checksums], ...] or raises its error. A stop signal sent
        to the whole job (Slurm, a process group) is the trainer's to handle: the writer
        finishes its files (kill -9 still ends it).
        """

        def write() -> dict[str, Any]:
            storage = open_storage(prep.uri, prep.storage.storage_options)  # fresh fs
            return write_files(prep, rank, storage.staging(prep.token))

        return fork_call(write, "async save writer", ignore=STOP_SIGNALS)  # type: ignore[no-any-return]

    def wait(self) -> None:
        """Block until every save this saver started has finished (errors re-raised)."""
        while self._inflight:
            self._inflight.popleft().result()

    def close(self, *, raise_errors: bool = True) -> None:
        """Wait for every save in flight, then stop. A failed save's error is raised here
        unless ``raise_errors`` is false: a caller that reads each save's own future (the
        checkpoint manager) has reported it already."""
        try:
            if raise_errors:
                self.wait()
            else:
                futures_wait(self._inflight)
                self._inflight.clear()
        finally:
            self._pool.shutdown(wait=True)
            if self._own_stager:
                self._stager.close()
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
    checksum: str = "crc32c",
    overwrite: bool = False,
    check_replicas: bool = True,
    io_threads: int | str | None = None,
) -> Future[CheckpointIndex]:
    """Like :func:`reshard_svc.save`, but returns once the state is staged.

    Called by every rank. At most one save per process group is in flight: a second call
    waits for the first. The first call creates a dedicated gloo group (collective).
    """
    key = process_group
    saver = _SAVERS.get(key)
    if saver is None:
        saver = _SAVERS[key] = AsyncSaver(process_group)
    saver.io_threads = None if io_threads is None else count_io_threads(io_threads)
    return saver.save(
        state_dict,
        uri,
        storage_options=storage_options,
        checksum=checksum,
        overwrite=overwrite,
        check_replicas=check_replicas,
    )
