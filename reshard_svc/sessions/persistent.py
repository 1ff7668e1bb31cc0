"""A :class:`~reshard_svc.CheckpointManager`'s persistent tier: step folders under one root.

Every rank builds one (collective, through the manager's :class:`~reshard_svc.runtime.comm.Comm`).
It holds the root's lease (rank 0, for the manager's lifetime: a second job aimed at the
same root fails naming the holder), saves a step in the background (its
:class:`~reshard_svc.runtime.async_save.AsyncSaver`, one save in flight) or inline, and
after each commit applies retention on rank 0 (:mod:`reshard_svc.plan.retention`) and calls
``on_commit``. What a step folder is on storage (its name, committed or not, retiring it,
its leftovers) is :class:`~reshard_svc.format.steps.StepFolders`'s; this tier decides when.

The manager composes it with the fast tier (:mod:`reshard_svc.sessions.fast`) behind the
same door: ``due`` / ``save`` / ``wait`` / the newest step / ``close``. Threads: the
caller's thread drives :meth:`PersistentSaves.save` and :meth:`PersistentSaves.finish` (on
the manager's group); the saver's background thread a channel of that group
(:class:`~reshard_svc.runtime.comm.Channel`); the tier's ``post``
thread (``reshard-manager``) waits for each commit and runs retention after it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from reshard_svc.errors import (
    CheckpointError,
    DistributedError,
    SaveFailedError,
    StorageError,
    TornSnapshotError,
)
from reshard_svc.format.collect import collect_lease_debris
from reshard_svc.format.index import INDEX_NAME, CheckpointIndex
from reshard_svc.format.steps import StepFolders
from reshard_svc.plan.retention import retained
from reshard_svc.runtime.async_save import AsyncSaver
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.load import load as load_checkpoint
from reshard_svc.runtime.save import save as save_checkpoint
from reshard_svc.runtime.staging import Stager
from reshard_svc.storage.leases import Lease

__all__ = ["PersistentSaves"]

logger = logging.getLogger(__name__)


def _torn(error: BaseException | None) -> bool:
    """Whether a background save failed only because its snapshot was torn (on this rank,
    or on the ranks whose failure this rank learned)."""
    if isinstance(error, TornSnapshotError):
        return True
    if isinstance(error, DistributedError):
        return bool(error.failures) and all(
            str(m).startswith("TornSnapshotError") for m in error.failures.values()
        )
    return False


class PersistentSaves:
    """The persistent tier at work inside a manager: every rank builds one (collective)."""

    def __init__(
        self,
        root: str,
        comm: Comm,
        *,
        interval: int,
        keep_last: int | None,
        keep_every: int | None,
        async_save: bool,
        process_group: Any,
        storage_options: Mapping[str, Any],
        checksum: str,
        io_threads: int | None,
        on_commit: Callable[[int, str], Any] | None,
        stager: Stager,
    ) -> None:
        self.root = root
        self.comm = comm
        self.interval, self.keep_last, self.keep_every = interval, keep_last, keep_every
        self.folders = StepFolders(root, storage_options)
        self.process_group = process_group
        self.storage_options = dict(storage_options)
        self.checksum = checksum
        self.io_threads = io_threads
        self.on_commit = on_commit
        self._lease: Lease | None = None
        self._retention = threading.Lock()
        comm.run_everywhere(f"CheckpointManager({root!r}): taking the root", self._take_root)
        self._saver = (
            AsyncSaver(io_threads=io_threads, stager=stager, comm=comm) if async_save else None
        )
        # commit, then retention: the pending save is done when both are
        self._post = ThreadPoolExecutor(1, thread_name_prefix="reshard-manager")
        self._pending: tuple[int, Future[Any]] | None = None

    # ---- the root

    def _take_root(self) -> None:
        if self.comm.rank != 0:
            return
        storage = self.folders.prepare()
        token = uuid.uuid4().hex
        self._lease = Lease.acquire(
            storage,
            self.root,
            token,
            "checkpoint-manager",
            lambda holder, state: None,  # type: ignore[arg-type]
        )
        try:  # what a dead job's operations on the root's lease left beside it
            collect_lease_debris(storage)
        except OSError as e:
            logger.warning("could not collect the lease debris beside %s: %s", self.root, e)
        # before anyone asks for the latest step: a dead job's decided commit is finished,
        # so the step it saved is the one a resume loads
        self.folders.finish_interrupted()

    def uri(self, step: int) -> str:
        return self.folders.uri(step)

    def steps(self) -> list[int]:
        """Committed steps (their index exists), oldest first."""
        return self.folders.committed()

    # ---- saving

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    @property
    def in_background(self) -> bool:
        """Whether a due step is saved in the background (``async_save``)."""
        return self._saver is not None

    def status(self) -> tuple[bool, bool]:
        """This rank's view of the save in flight: (it failed, it is still running)."""
        if self._pending is None:
            return False, False
        future = self._pending[1]
        if not future.done():
            return False, True
        return future.exception() is not None, False

    def save(self, step: int, state: Mapping[str, Any], *, overlap: bool, share: object) -> None:
        """Stage ``state`` as ``step`` and write it in the background (the save in flight
        is finished first: :meth:`finish`)."""
        if self._saver is None:
            raise CheckpointError("this persistent tier saves inline: call save_now")
        future = self._saver.save(
            state,
            self.uri(step),
            storage_options=self.storage_options,
            checksum=self.checksum,
            overlap=overlap,
            share=share,
        )
        self._pending = (step, self._post.submit(self._after_commit, future, step))

    def save_now(self, step: int, state: Mapping[str, Any]) -> None:
        """Save ``state`` as ``step`` before returning (a stop signal, or no ``async_save``)."""
        save_checkpoint(
            state,
            self.uri(step),
            process_group=self.process_group,
            storage_options=self.storage_options,
            checksum=self.checksum,
            io_threads=self.io_threads,
        )
        if self.comm.rank == 0:
            self._committed(step)

    def finish_copies(self) -> None:
        if self._saver is not None:
            self._saver.finish_copies()

    def finish(self) -> None:
        """Wait for the save in flight; its failure is raised on every rank (a torn
        snapshot on every rank that failed: one warning, the step does not count)."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        error = future.exception()
        _, said = self.comm.run_everywhere(
            f"checkpoint step {step}",
            lambda: None,
            share=lambda _: {"error": f"{error}" if error else "", "torn": _torn(error)},
        )
        failures = {r: x["error"] for r, x in enumerate(said) if x["error"]}
        if failures and all(x["torn"] for x in said if x["error"]):
            logger.warning(
                "step %d does not count (nothing of it was committed; the previous step stays "
                "the resume point): %s",
                step,
                next(iter(failures.values())),
            )
            return
        if failures:
            text = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
            raise SaveFailedError(
                f"the background save of step {step} to {self.uri(step)} failed, so step "
                f"{step} is not committed: {text}",
                step,
                failures,
            ) from error

    # ---- retention (rank 0, after each commit)

    def _after_commit(self, future: Future[Any], step: int) -> Any:
        """The background save's result, once rank 0 has applied retention after it."""
        result = future.result()
        if self.comm.rank == 0:
            self._committed(step)
        return result

    def _committed(self, step: int) -> None:
        """Rank 0, after ``step`` committed: retention, then the ``on_commit`` hook."""
        self._retain()
        if self.on_commit is not None:
            try:
                self.on_commit(step, self.uri(step))
            except Exception:  # an export never fails training
                logger.warning("on_commit for step %d failed", step, exc_info=True)

    def _retain(self) -> None:
        with self._retention:
            try:
                committed = self.steps()
                keep = retained(committed, self.keep_last, self.keep_every)
                holds = getattr(self.on_commit, "holds", None)
                if holds is not None:
                    keep |= set(holds())  # still being read (an export job)
                for step in sorted(set(committed) - keep):
                    self.folders.retire(step)  # only what its index lists goes
                self.folders.collect(set(committed) & keep)  # what dead saves left
            except Exception:  # housekeeping never fails training
                logger.warning("retention under %s failed", self.root, exc_info=True)

    # ---- loading

    def pick(self, step: int | None) -> tuple[int | None, CheckpointIndex | None]:
        """Rank 0 finds the step to load (``step``, or the newest whose index parses) and
        checks its index; every rank gets it."""

        def find() -> Any:
            if self.comm.rank != 0:
                return None
            candidates = (
                [step] if step is not None else sorted(self.folders.folders(), reverse=True)
            )
            skipped = []
            for s in candidates:
                storage = self.folders.storage(s)
                try:
                    raw = storage.read(INDEX_NAME)
                    CheckpointIndex.loads(raw, f"{storage.uri}/{INDEX_NAME}").check()
                except (CheckpointError, StorageError) as e:
                    if step is not None:
                        raise CheckpointError(
                            f"step {step} under {self.root} cannot be loaded: {e}"
                        ) from e
                    skipped.append(f"{s} ({type(e).__name__})")
                    continue
                if skipped:
                    logger.warning(
                        "skipped uncommitted or unreadable steps under %s: %s",
                        self.root,
                        ", ".join(skipped),
                    )
                return s
            return None

        _, found = self.comm.run_everywhere(f"finding a step to load under {self.root}", find)
        chosen = found[0]
        if chosen is None:
            return None, None
        storage = self.folders.storage(chosen)
        return chosen, CheckpointIndex.loads(storage.read(INDEX_NAME))

    def load(self, view: dict[str, Any], step: int, strict: bool) -> int:
        """Fill ``view`` from ``step``; the bytes read."""
        stats = load_checkpoint(
            view,
            self.uri(step),
            process_group=self.process_group,
            strict=strict,
            storage_options=self.storage_options,
        )
        return int(stats.bytes_read)

    # ---- lifetime

    def close(self) -> None:
        """Stop the saver and the post thread and release the root (the save in flight is
        the caller's to :meth:`finish` first)."""
        try:
            if self._saver is not None:
                self._saver.close(raise_errors=False)  # finish() reported each step's
        finally:
            self._post.shutdown(wait=True)
            with self._retention:
                if self._lease is not None:
                    self._lease.release()
                    self._lease = None
