"""``CheckpointManager``: a training loop's checkpoints under one root, one step folder each.

Every rank constructs it (collective) and calls :meth:`~CheckpointManager.save` every step;
the manager decides whether the step is due (``interval``), saves asynchronously with one
save in flight (``save`` blocks only for the snapshot, and for the previous save when it
has not finished), and after each commit applies the retention policy
(:mod:`reshard_svc.plan.retention`). Order of events in one ``save(step, state)`` call, on
every rank:

1. one small all-reduce on the manager's own gloo group: did any rank receive a stop
   signal (``save_on_signals``), did any rank's previous background save fail;
2. a failed previous save is raised as :class:`~reshard_svc.errors.SaveFailedError` on
   every rank, naming its step (that step never committed);
3. if the step is due: wait for the previous save, then snapshot and return (async), or,
   when a stop was asked for, save this step synchronously and set :attr:`should_stop`.

Layout on storage: ``ROOT/step-0000000100/`` (our format, committed when its
``reshard.index.json`` lands, as every save). Rank 0 holds a lease on ``ROOT`` for the
manager's lifetime, so a second job aimed at the same root fails at construction naming
the holder. Retention deletes only committed step folders of its own naming that the
policy drops (their index first, then the files the index lists; foreign files stay), and
collects what dead saves left (stale leases only); a failure to delete is a warning. What a
step folder is on storage (its name, committed or not, retiring it, its leftovers) is
:class:`~reshard_svc.format.steps.StepFolders`'s; the manager decides when.

The manager composes two tiers behind one stager: the persistent tier
(:class:`~reshard_svc.sessions.persistent.PersistentSaves`: the root's lease, the
background saver, retention) and, given ``fast=``, the fast tier
(:class:`~reshard_svc.sessions.fast.FastSaves`). It keeps what spans both: the agreement
of each call, stop signals, ``if_busy``, the overlap hooks, which tier a resume loads from,
and the ``rank_local`` keys.

Per-rank state (RNG, a data loader's position) is saved under per-rank keys: name its
top-level keys in ``rank_local`` and each rank's value is stored as ``rank_local.<rank>.<key>``;
a resumed job whose rank has no saved value (a larger world) keeps the value it passed,
with one warning, while every other key still loads strictly.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from reshard_svc.errors import StateDictError, UsageError
from reshard_svc.plan.budget import io_threads as count_io_threads
from reshard_svc.plan.retention import check_policy
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.staging import Stager
from reshard_svc.runtime.state_dict import flatten
from reshard_svc.sessions.fast import FastSaves, FastTier, RestoreInfo
from reshard_svc.sessions.persistent import PersistentSaves
from reshard_svc.sessions.steps import StepInfo, list_steps  # the root as `reshard steps` shows it

__all__ = ["CheckpointManager", "Saved", "StepInfo", "list_steps"]

#: why :meth:`CheckpointManager.save` did or did not save
SAVED, NOT_DUE, DEFERRED = "saved", "not due", "deferred: the previous save is still in flight"


@dataclass(frozen=True, kw_only=True)
class Saved:
    """What one :meth:`CheckpointManager.save` call did: true when it saved; ``reason``
    says why not (``not due``, or ``deferred: ...`` under ``if_busy="defer"``)."""

    saved: bool
    reason: str

    def __bool__(self) -> bool:
        return self.saved


logger = logging.getLogger(__name__)

#: The extras key each step's index records its step under.
STEP_KEY = "checkpoint_manager"
RANK_LOCAL = "rank_local"


def _checked(
    interval: Any,
    keep_last: int | None,
    keep_every: int | None,
    if_busy: str,
    fast: Any,
    optimizers: Iterable[Any],
) -> list[Any]:
    """A manager's settings checked before anything is taken (a :class:`UsageError`
    naming the one to fix); returns the optimizers as a list."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise UsageError(f"interval must be a positive integer, got {interval!r}")
    check_policy(keep_last, keep_every)
    if if_busy not in ("wait", "defer"):
        raise UsageError(f"if_busy must be 'wait' or 'defer', got {if_busy!r}")
    if fast is not None and not isinstance(fast, FastTier):
        raise UsageError(f"fast must be a reshard_svc.FastTier, got {type(fast).__name__}")
    return _hookable(optimizers)


def _hookable(optimizers: Iterable[Any]) -> list[Any]:
    """``optimizers`` as a list, each one able to take a step pre-hook."""
    out = list(optimizers)
    for opt in out:
        if not callable(getattr(opt, "register_step_pre_hook", None)):
            raise UsageError(
                f"optimizers: {type(opt).__name__} takes no step pre-hook; pass "
                "torch.optim optimizers"
            )
    return out


class CheckpointManager:
    """Checkpoints of one training job under ``root`` (any fsspec URI). Construct on every
    rank of ``process_group`` (collective); use as a context manager or call :meth:`close`.

    Args:
        interval: a step is saved when ``step % interval == 0`` (or ``force``, or a stop).
        keep_last / keep_every: the retention policy (``None``: keep everything).
        async_save: ``save`` returns after the snapshot (default); ``False`` saves inline.
        save_on_signals: signals (``signal.SIGTERM``, ``signal.SIGUSR1``) that ask for a
            final checkpoint at the next ``save`` call and set :attr:`should_stop`.
        rank_local: top-level state keys each rank saves on its own (RNG, data position).
        on_commit: called on rank 0 as ``on_commit(step, uri)`` after each step commits (in
            the background, after retention; an exception is a warning, never a training
            failure). If it has a ``holds()`` method, the steps it returns are kept by
            retention until released (an export still reading them):
            ``reshard_client.ExportOnCommit`` asks a reshard-server to convert every K-th
            step.
        if_busy: what a due save does while the previous one is still in flight on some
            rank: ``wait`` for it (default), or ``defer`` to the next call (training never
            waits on storage; ``force`` and a stop signal still wait), which then saves.
        io_threads: each rank's checking writers (default: ``RESHARD_IO_THREADS``, else from
            the CPUs this process may use and the ranks on its node).
        fast: a :class:`~reshard_svc.FastTier`: every ``fast.every`` steps each rank's
            shards also go to its node's fast path and to ``copies - 1`` other nodes;
            :meth:`load` resumes from the newest whole fast step when it is not older than
            the persistent root's (:mod:`reshard_svc.sessions.fast`).
        optimizers: overlap mode. ``save`` returns once the snapshot's copies are queued
            (a side CUDA stream; a side thread for CPU state that is copied), and a step
            pre-hook on each optimizer waits for the copies not yet finished before it
            steps (:attr:`last_wait_s`). In every mode a tensor changed in place before
            its copy finished makes that step not count (one warning naming it; the
            previous step stays the resume point): a torn snapshot is never committed.
    """

    def __init__(
        self,
        root: str,
        *,
        interval: int = 1,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = True,
        save_on_signals: Iterable[int] = (),
        rank_local: Iterable[str] = (),
        process_group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        checksum: str = "crc32c",
        on_commit: Callable[[int, str], Any] | None = None,
        fast: FastTier | None = None,
        if_busy: str = "wait",
        io_threads: int | str | None = None,
        optimizers: Iterable[Any] = (),
    ) -> None:
        optimizers = _checked(interval, keep_last, keep_every, if_busy, fast, optimizers)
        self.io_threads = None if io_threads is None else count_io_threads(io_threads)
        self.root = root.rstrip("/")
        self.interval, self.keep_last, self.keep_every = interval, keep_last, keep_every
        self.rank_local = tuple(rank_local)
        self.process_group = process_group
        self.storage_options = dict(storage_options or {})
        self.checksum = checksum
        self.on_commit = on_commit
        self.should_stop = False
        #: where the last :meth:`load` came from (step, tier, bytes by source, seconds)
        self.last_restore: RestoreInfo | None = None
        self.if_busy = if_busy
        self._owed = False  # a due save was deferred: the next call saves
        #: how long training last waited on checkpoints (seconds): a due ``save`` for the
        #: previous save to commit, or (overlap mode) an optimizer for the copies
        self.last_wait_s = 0.0
        self._signalled: int | None = None
        self._closed = False
        self._start(async_save, fast)
        self._previous_handlers: dict[int, Any] = {}
        for sig in save_on_signals:
            self._install(sig)
        self._copying = False  # overlap mode: a save's copies may still be running
        self._hooks = [opt.register_step_pre_hook(self._before_step) for opt in optimizers]

    def _start(self, async_save: bool, fast: FastTier | None) -> None:
        """The manager's one gloo group (the caller's thread agrees on it, each tier's
        background thread on a channel of it), then its two tiers behind one stager
        (collective); when the fast tier cannot start, nothing of this manager stays and
        the root is free again."""
        self._group = None
        if dist.is_available() and dist.is_initialized():
            pg = self.process_group
            ranks = None if pg is None else dist.get_process_group_ranks(pg)
            # the manager's agreements never share a communicator with training's
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        self.comm = Comm(self._group)
        # one stager for both tiers: a step due on both is staged once
        self._stager = Stager("the checkpoint manager")
        self._persistent = PersistentSaves(
            self.root,
            self.comm,
            interval=self.interval,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            async_save=async_save,
            process_group=self.process_group,
            storage_options=self.storage_options,
            checksum=self.checksum,
            io_threads=self.io_threads,
            on_commit=self.on_commit,
            stager=self._stager,
        )
        self._fast: FastSaves | None = None
        if fast is not None:
            try:
                self._fast = FastSaves(fast, self.comm, self.process_group, self._stager)
            except BaseException:
                self._persistent.close()
                if self._group is not None:
                    dist.destroy_process_group(self._group)
                raise

    def _install(self, sig: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise UsageError("save_on_signals needs the manager to be built on the main thread")

        def handler(signum: int, frame: Any) -> None:
            self._signalled = signum

        self._previous_handlers[sig] = signal.signal(sig, handler)

    # ---- what is on storage

    def _step_uri(self, step: int) -> str:
        return self._persistent.uri(step)

    def steps(self) -> list[int]:
        """Committed steps (their index exists), oldest first."""
        return self._persistent.steps()

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ---- saving

    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False) -> Saved:
        """Called by every rank every step. Saves ``state`` as ``step`` when due (every
        ``interval``, or ``force``, or a stop signal, or a save deferred by ``if_busy``);
        returns a :class:`Saved`, true when it saved (and why not, when not). A failure of
        the previous background save raises :class:`SaveFailedError` here, on every
        rank."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative integer, got {step!r}")
        # a step due on both tiers is staged once: the fast tier's stage, held by the
        # persistent tier too
        with self._stager.sharing() as share:
            return self._save(step, state, force, share)

    def _save(self, step: int, state: Mapping[str, Any], force: bool, share: object) -> Saved:
        stop, busy = self._agree()
        due = force or stop or self._persistent.due(step) or self._owed
        overlap = bool(self._hooks) and not stop
        if self._fast is not None and (stop or self._fast.due(step)):
            self._fast.save(step, self._with_step(step, state), overlap=overlap, share=share)
            self._copying = overlap
            if stop:
                self._fast.wait()  # preemption: the fast copy first (seconds), then the root
        if not due:
            return Saved(saved=False, reason=NOT_DUE)
        if stop or not self._persistent.in_background:
            self._persistent.finish()
            self._persistent.save_now(step, self._with_step(step, state))
            self._owed = False
            if stop:
                self.should_stop = True
                logger.warning("stop signal: saved step %d synchronously; should_stop is set", step)
            return Saved(saved=True, reason=SAVED)
        if busy and self.if_busy == "defer" and not force:
            self._owed = True  # the next call saves, once the save in flight is done
            return Saved(saved=False, reason=DEFERRED)
        self._owed = False
        started = time.monotonic()
        self._persistent.finish()
        waited = self.last_wait_s = time.monotonic() - started
        if waited > 0.05:
            logger.info("step %d waited %.2f s for the previous save to commit", step, waited)
        self._persistent.save(step, self._with_step(step, state), overlap=overlap, share=share)
        self._copying = overlap
        return Saved(saved=True, reason=SAVED)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An optimizer's step pre-hook (overlap mode): the copies of the last save finish
        before any tensor changes in place."""
        if not self._copying:
            return
        started = time.perf_counter()
        self._persistent.finish_copies()
        if self._fast is not None:
            self._fast.finish_copies()
        self._copying = False
        self.last_wait_s = time.perf_counter() - started

    def _agree(self) -> tuple[bool, bool]:
        """One small all-reduce: (a stop was asked for, a previous save failed, a save is
        still in flight on some rank); returns (stop, busy)."""
        failed, busy = self._persistent.status()
        stop, any_failed, any_busy = self.comm.all_reduce_max(
            [int(self._signalled is not None), int(failed), int(busy)]
        )
        if any_failed:
            self._persistent.finish()  # every rank's save of that step fails: raise it
        return bool(stop), bool(any_busy)

    def _with_step(self, step: int, state: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(state)
        if STEP_KEY in out or RANK_LOCAL in out:
            raise UsageError(f"state keys {STEP_KEY!r} and {RANK_LOCAL!r} are the manager's")
        out[STEP_KEY] = {"step": step}
        local = {k: out.pop(k) for k in self.rank_local if k in out}
        if local:
            out[RANK_LOCAL] = {str(self.comm.rank): local}
        return out

    # ---- loading

    def load(
        self, state: Mapping[str, Any], *, step: int | None = None, strict: bool = True
    ) -> int | None:
        """Fill ``state`` (any layout) from ``step``, or by default from the newest step:
        the newest whole fast step when there is a fast tier and it is not older than the
        persistent root's newest, else the newest committed persistent step whose index parses
        (half-written or unreadable steps are skipped with a warning). Returns the step
        loaded, or None when there is none (a fresh start); :attr:`last_restore` says from
        where. Called by every rank."""
        self._check_open()
        started = time.perf_counter()
        chosen, index = self._persistent.pick(step)
        if self._fast is not None and step is None:
            choice = self._fast.choose(newer_than=chosen)
            if choice is not None:
                self._fast.forget_after(choice.step)
                view = self._view(state, choice.step, choice.names | set(choice.extras))
                tensors = self._fill_values(view, choice.extras, choice.names, strict)
                self.last_restore = self._fast.fill(choice, tensors, started)
                self._write_back(state, view)
                return choice.step
        if chosen is None or index is None:
            self.last_restore = RestoreInfo(
                step=None,
                tier="none",
                bytes_local=0,
                bytes_peer=0,
                bytes_persistent=0,
                seconds=time.perf_counter() - started,
            )
            return None
        if self._fast is not None:
            self._fast.forget_after(chosen)
        view = self._view(state, chosen, {*index.tensors, *index.extras})
        read = self._persistent.load(view, chosen, strict)
        self._write_back(state, view)
        self.last_restore = RestoreInfo(
            step=chosen,
            tier="persistent",
            bytes_local=0,
            bytes_peer=0,
            bytes_persistent=read,
            seconds=time.perf_counter() - started,
        )
        return chosen

    def _view(self, state: Mapping[str, Any], step: int, names: set[str]) -> dict[str, Any]:
        """What to load of ``state``: its keys, with this rank's ``rank_local`` values under
        the names it saved them at (a value it never saved keeps what was passed in)."""
        view: dict[str, Any] = {k: v for k, v in state.items() if k not in self.rank_local}
        mine = f"{RANK_LOCAL}.{self.comm.rank}."
        have = {n for n in names if n.startswith(mine)}
        local: dict[str, Any] = {}
        for key in self.rank_local:
            if key not in state:
                continue
            if any(n == mine + key or n.startswith(mine + key + ".") for n in have):
                local[key] = state[key]
            else:
                logger.warning(
                    "step %d has no %r saved by rank %d (saved at another world size?): "
                    "keeping the value passed in",
                    step,
                    key,
                    self.comm.rank,
                )
        if local:
            view[RANK_LOCAL] = {str(self.comm.rank): local}
        return view

    def _fill_values(
        self, view: dict[str, Any], extras: Mapping[str, Any], names: set[str], strict: bool
    ) -> dict[str, Any]:
        """Set ``view``'s JSON values from a fast step's and return its tensors by name (what
        the step does not hold is refused on every rank with ``strict``, else skipped)."""

        def split() -> dict[str, Any]:
            tensors: dict[str, Any] = {}
            missing = []
            for name, leaf in flatten(view).items():
                if leaf.kind == "extra":
                    if name in extras:
                        leaf.parent[leaf.key] = extras[name]
                    elif not (isinstance(leaf.value, dict) and not leaf.value):
                        missing.append(name)
                elif name in names:
                    tensors[name] = leaf.value
                else:
                    missing.append(name)
            if missing and strict:
                raise StateDictError(
                    f"the fast step holds no {', '.join(repr(m) for m in missing[:5])}: pass "
                    "strict=False to load the rest"
                )
            return tensors

        return self.comm.run_everywhere("fast tier: matching keys", split)[0]

    @staticmethod
    def _write_back(state: Mapping[str, Any], view: dict[str, Any]) -> None:
        target: Any = state
        rank_local = view.get(RANK_LOCAL, {})
        for key, value in view.items():
            if key != RANK_LOCAL:
                target[key] = value
        for values in rank_local.values():
            for key, value in values.items():
                target[key] = value

    # ---- lifetime

    def wait(self) -> None:
        """Block until the saves in flight have finished: the persistent one committed (its
        failure raised on every rank), and the fast one (a failure there is a warning)."""
        self._check_open()
        self._persistent.finish()
        if self._fast is not None:
            self._fast.wait()

    def close(self) -> None:
        """Wait for the save in flight, then release the root (and the signal handlers)."""
        if self._closed:
            return
        try:
            self._persistent.finish()
        finally:
            self._closed = True
            for sig, previous in self._previous_handlers.items():
                signal.signal(sig, previous)
            try:
                self._persistent.close()
                if self._fast is not None:
                    self._fast.close()
            finally:
                self._stager.close()
                for hook in self._hooks:
                    hook.remove()
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    def fast_steps(self) -> list[int]:
        """The committed fast steps this rank's node holds, oldest first."""
        if self._fast is None:
            return []
        return sorted({s.step for s in self._fast.steps() if s.committed})

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("this CheckpointManager is closed")
