"""The fast tier of a :class:`~reshard_svc.CheckpointManager`: node memory and peer copies.

``FastTier(path, every=10, copies=2)`` makes the manager, every ``every`` steps, snapshot
each rank's shards (a copy into reused staging buffers: the stall) and, in the
background, on a channel of the manager's gloo group (tagged messages:
:class:`~reshard_svc.runtime.comm.Channel`):

1. write them as this rank's *part* under its node's fast path (our format: safetensors,
   a partial index, block CRC32Cs; :mod:`reshard_svc.format.fast`);
2. send the part to ``copies - 1`` ranks on other nodes, which check every block and
   publish it under their own node's fast path;
3. agree that every part has all its copies; then every rank writes the
   step's commit record on its node and removes the fast steps older than the newest two.

A failure anywhere (a full tmpfs, a bad copy) is a warning on every rank and the step does
not count; training and the persistent tier go on.

Restore (``mgr.load``) asks every rank what its node's fast path holds, and picks the
newest committed fast step whose every part survives in some copy (when the persistent
root has no newer step). Each needed part is read on a node that holds it, checked block
by block (a bad copy is skipped for another, named in one warning), and moved by
:func:`~reshard_svc.transfer` into the layout the new job uses: any world size, any mesh.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from reshard_svc._process import fork_call
from reshard_svc.errors import CheckpointError, ReshardError, TornSnapshotError, UsageError
from reshard_svc.format.fast import (
    FastStep,
    fast_steps,
    local_root,
    make_step_folder,
    pack_part,
    part_target,
    remove_fast_step,
    remove_part,
    unpack_part,
    write_commit,
)
from reshard_svc.format.steps import step_name
from reshard_svc.jobs.environment import NODE_RANK_ENV, node_rank
from reshard_svc.plan.items import Held, Holdings
from reshard_svc.plan.save import plan_save
from reshard_svc.runtime.async_save import STOP_SIGNALS
from reshard_svc.runtime.buffers import BackgroundWriter, release
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.save import WRITE_QUEUE_BYTES, saved_index, write_file
from reshard_svc.runtime.staging import Staged, Stager, can_fork
from reshard_svc.runtime.state_dict import flatten
from reshard_svc.runtime.targets import Placed, describe
from reshard_svc.sessions.fast_restore import Choice, FastRestore, RestoreInfo
from reshard_svc.storage import open_storage
from reshard_svc.storage.leases import Lease

__all__ = ["Choice", "FastSaves", "FastTier", "RestoreInfo"]

logger = logging.getLogger(__name__)

#: Fast steps each node keeps (committed); the one being written comes on top.
KEEP = 2


@dataclass(frozen=True)
class FastTier:
    """Node-local checkpoints every ``every`` steps, each shard on ``copies`` nodes.

    ``path`` is a folder on each node's own fast storage (tmpfs: ``/dev/shm/...``), the
    same text on every rank (each node's is its own). ``node`` is this rank's node; by
    default torchrun's (``GROUP_RANK``). It takes about ``2 x copies x`` the node's share
    of the state in ``path`` (two fast steps), plus a copy of this rank's shards in host
    memory (the snapshot)."""

    path: str
    _: KW_ONLY
    every: int
    copies: int = 2
    node: int | None = None

    def __post_init__(self) -> None:
        local_root(self.path)
        for what, value, low in (("every", self.every, 1), ("copies", self.copies, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UsageError(f"FastTier {what} must be an integer >= {low}, got {value!r}")
        if self.node is not None and (
            isinstance(self.node, bool) or not isinstance(self.node, int) or self.node < 0
        ):
            raise UsageError(f"FastTier node must be an integer >= 0, got {self.node!r}")

    def node_id(self) -> int:
        if self.node is not None:
            return self.node
        raw = node_rank() or "0"
        try:
            return int(raw)
        except ValueError:
            raise UsageError(
                f"{NODE_RANK_ENV}={raw!r} is not a node number: pass FastTier(node=)"
            ) from None


# ---- the snapshot: this rank's boxes in reused host buffers


class _Snapshot:
    """This rank's tensors, staged (:class:`~reshard_svc.runtime.staging.Stager`: buffers
    reused from one save to the next, or a forked writer's copy-on-write view), and its
    JSON values.

    Ownership: the staging buffers are the background step's from :meth:`take` until that
    step has finished (:meth:`FastSaves._write` releases them), then the stager's again."""

    def __init__(self, stager: Stager) -> None:
        self.stager = stager
        self.staged: Staged | None = None
        self.placed: dict[str, Placed] = {}
        self.extras: dict[str, Any] = {}

    def take(self, state: Mapping[str, Any], overlap: bool = False, share: object = None) -> bool:
        """Stage this rank's tensors (``overlap``: the copies may still run on return;
        ``share``: see :meth:`Stager.stage`); returns whether a forked writer may write
        them (CPU state: contiguous boxes stay live views, its copy-on-write memory holds
        them)."""
        extras: dict[str, Any] = {}
        described: dict[str, Placed] = {}
        for name, leaf in flatten(state).items():
            if leaf.kind == "extra":
                extras[name] = json.loads(json.dumps(leaf.value))
            else:
                described[name] = describe(leaf)
        views = can_fork(v for p in described.values() for v in p.local.values())
        self.staged = self.stager.stage(described, fork=views, overlap=overlap, share=share)
        self.placed = self.staged.placed
        self.extras = extras
        return views

    def finish_copies(self) -> list[str]:
        """Wait for this snapshot's copies (see :meth:`Staged.finish_copies`)."""
        return self.staged.finish_copies() if self.staged is not None else []

    def release(self) -> None:
        """The background step is done with the buffers."""
        if self.staged is not None:
            self.staged.release()


# ---- who sends its part to whom


def peers(nodes: list[int], copies: int) -> dict[int, list[int]]:
    """rank -> the ranks (on other nodes) its part is copied to: the ``c``-th copy goes
    to the rank at the same position on the ``c``-th next node. Fewer nodes than copies
    give fewer copies."""
    order = sorted(set(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        i = order.index(node)
        pos = members[node].index(rank)
        out[rank] = []
        for c in range(1, min(copies, len(order))):
            other = members[order[(i + c) % len(order)]]
            out[rank].append(other[pos % len(other)])
    return out


# ---- the saves


class FastSaves:
    """A :class:`FastTier` at work inside a manager: every rank builds one (collective)."""

    def __init__(
        self, tier: FastTier, comm: Comm, process_group: Any, stager: Stager | None = None
    ) -> None:
        self.tier = tier
        self.comm = comm
        self.process_group = process_group
        self.root = local_root(tier.path)
        _, nodes = comm.run_everywhere(
            f"FastTier({tier.path!r}): naming nodes", lambda: None, share=lambda _: tier.node_id()
        )
        self.nodes: list[int] = [int(n) for n in nodes]
        self.node = self.nodes[comm.rank]
        self.peers = peers(self.nodes, tier.copies)
        if tier.copies > 1 and len(set(self.nodes)) < tier.copies and comm.rank == 0:
            logger.warning(
                "FastTier(copies=%d) on %d node(s): each shard has %d copies (one per node)",
                tier.copies,
                len(set(self.nodes)),
                min(tier.copies, len(set(self.nodes))),
            )
        self.senders = {r: [s for s, to in self.peers.items() if r in to] for r in self.peers}
        _, tokens = comm.run_everywhere(
            "FastTier: the run's token", lambda: None, share=lambda _: uuid.uuid4().hex[:12]
        )
        self.run = str(tokens[0])
        # the background thread's agreements and copies: a channel of the manager's group
        self._bg = comm.channel("the fast tier's background thread")
        self._lease: Lease | None = None
        try:
            comm.run_everywhere(f"FastTier({tier.path!r}): taking the fast path", self._take)
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise
        self._own_stager = stager is None  # else the manager's, shared with its other tier
        self._snapshot = _Snapshot(stager if stager is not None else Stager("the fast tier"))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="reshard-fast")
        self._pending: Future[tuple[bool, int]] | None = None
        self._counted: int | None = None  # this run's newest fast step that counts
        self._lock = threading.Lock()
        #: whether the last fast save that finished committed
        self.last_ok: bool | None = None

    # ---- the node's path

    def _take(self) -> None:
        """The lowest rank of each node holds the node path's lease: a second job on it
        fails here, naming the first."""
        if min(r for r, n in enumerate(self.nodes) if n == self.node) != self.comm.rank:
            return
        storage = open_storage(self.root, {"sync_files": False})
        storage.make_folder()
        self._lease = Lease.acquire(
            storage, self.root, uuid.uuid4().hex, "fast-tier", lambda holder, state: None
        )

    def steps(self) -> list[FastStep]:
        """The fast steps this node holds."""
        return fast_steps(self.root)

    # ---- saving

    def due(self, step: int) -> bool:
        return step % self.tier.every == 0

    def save(
        self, step: int, state: Mapping[str, Any], overlap: bool = False, share: object = None
    ) -> None:
        """Every rank: wait for the fast save in flight, snapshot (``overlap``: copies
        queued, see :meth:`finish_copies`; ``share``: see :meth:`Stager.stage`), and write
        in the background."""
        self.wait()
        if step == self._counted:
            return  # this run's fast step of this number already counts (a forced save)
        fork = self._snapshot.take(state, overlap, share)  # each leaf described once
        prepared: Callable[[], Any] | str | None = None
        if fork:  # the part is written by a copy-on-write child: the stall is the fork
            try:
                folder = self._prepare(step)
                prepared = fork_call(
                    functools.partial(self._write_part, folder, self.comm.rank, self._snapshot),
                    "fast tier: the part writer",
                    ignore=STOP_SIGNALS,
                )
            except Exception as e:  # the exchange still runs, saying this rank has no part
                prepared = f"rank {self.comm.rank}: preparing its part of step {step}: {e}"
        self._pending = self._pool.submit(self._write, step, prepared)

    def finish_copies(self) -> list[str]:
        """Wait for the snapshot's copies (see :meth:`Stager.finish_copies`)."""
        return self._snapshot.stager.finish_copies()

    def _whole_snapshot(self) -> None:
        """Once the snapshot's copies are done: :class:`TornSnapshotError` when a tensor
        changed in place before its copy finished."""
        torn = self._snapshot.finish_copies()  # this snapshot's, whatever was staged since
        if torn:
            raise TornSnapshotError(
                f"{', '.join(repr(t) for t in torn[:5])} changed in place before the "
                "snapshot's copy finished (wait for the copies before optimizer.step)",
                torn,
            )

    def wait(self) -> bool | None:
        """Wait for the fast save in flight; whether it committed (None: none was)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        ok, step = pending.result()
        self.last_ok = ok
        if ok:
            self._counted = step  # every rank learned the same outcome
        return ok

    def _prepare(self, step: int) -> str:
        """The step's folder on this node, without what an earlier attempt at it left
        (it did not count) of the parts this rank writes."""
        folder = make_step_folder(self.root, step, self.run)
        for origin in (self.comm.rank, *self.senders[self.comm.rank]):
            remove_part(folder, origin)
        return folder

    def _write(self, step: int, prepared: Callable[[], Any] | str | None) -> tuple[bool, int]:
        """The background part of a fast save (every rank, on the fast tier's group, which
        this one thread alone drives): whether the step counts, and the step."""
        try:
            return self._write_step(step, prepared), step
        finally:
            self._snapshot.release()

    def _write_step(self, step: int, prepared: Callable[[], Any] | str | None) -> bool:
        folder = f"{self.root}/{step_name(step, self.run)}"
        error = ""
        blob = bytearray()
        try:
            if isinstance(prepared, str):
                raise CheckpointError(prepared)
            self._whole_snapshot()
            if prepared is None:
                folder = self._prepare(step)
                self._write_part(folder, self.comm.rank, self._snapshot)
            else:
                prepared()  # the forked writer's part, published
            blob = pack_part(folder, self.comm.rank)
        except Exception as e:  # a full tmpfs, ...: the step does not count
            error = f"rank {self.comm.rank}: writing its part under {folder}: {e}"
        received, recv_error = self._exchange(blob if not error else None)
        for origin, data in received.items():
            if recv_error:
                break
            try:
                unpack_part(folder, origin, data)
            except Exception as e:
                recv_error = f"rank {self.comm.rank}: the copy of rank {origin}'s part: {e}"
        error = error or recv_error
        shapes = {n: list(p.shape) for n, p in self._snapshot.placed.items()}
        _, said = self._bg.run_everywhere(
            "fast tier: did every part get its copies",
            lambda: None,
            share=lambda _: {"error": error, "tensors": shapes},
        )
        failed = [x["error"] for x in said if x["error"]]
        if failed:
            logger.warning(
                "fast tier: step %d does not count (training and the persistent tier go on): %s",
                step,
                "; ".join(failed[:4]),
            )
            return False
        tensors: dict[str, Any] = {}
        for x in said:
            tensors.update(x["tensors"])
        record = {
            "step": step,
            "run": self.run,
            "world": len(self.nodes),
            "nodes": self.nodes,
            "copies": self.tier.copies,
            "time": time.time(),
            "tensors": tensors,
        }
        try:
            write_commit(folder, record)
        except ReshardError as e:
            logger.warning("fast step %d: %s", step, e)
            return False
        self._retire()
        return True

    def _write_part(self, folder: str, rank: int, snap: _Snapshot) -> None:
        """Publish this rank's part (index last, then renamed into place)."""
        holdings = {
            name: Holdings(
                dtype=str(p.dtype).removeprefix("torch."),
                itemsize=p.dtype.itemsize,
                shape=p.shape,
                held=tuple(Held(box=b, holders=(0,)) for b in sorted(p.local)),
                layout=str(p.layout) if p.layout else None,
            )
            for name, p in snap.placed.items()
        }
        plan = plan_save(holdings, 1)
        target = part_target(folder, rank)
        staging = target.staging(uuid.uuid4().hex)
        written = []
        with BackgroundWriter(WRITE_QUEUE_BYTES) as background:
            for spec in plan.files_of(0):
                written.append(write_file(staging, spec, snap.placed, background, "crc32c", {}))
        index = saved_index(holdings, plan, written, snap.extras, "crc32c")
        target.commit(staging, index.dumps())

    def _exchange(self, blob: bytearray | None) -> tuple[dict[int, memoryview], str]:
        """Send this rank's part to its peers and receive the parts it keeps copies of:
        sizes first (-1: the sender has none), then the bytes."""
        me = self.comm.rank
        to, sources = self.peers[me], self.senders[me]
        if not self._bg.distributed or (not to and not sources):
            return {}, ""
        size = torch.tensor([len(blob) if blob is not None else -1], dtype=torch.int64)
        sizes = {s: torch.zeros(1, dtype=torch.int64) for s in sources}
        self._bg.swap(dict.fromkeys(to, size), sizes)
        payload = torch.frombuffer(blob, dtype=torch.uint8) if blob else None
        boxes = {s: torch.empty(int(sizes[s]), dtype=torch.uint8) for s in sources if sizes[s] > 0}
        self._bg.swap(dict.fromkeys(to, payload) if payload is not None else {}, boxes)
        if blob is not None:  # gloo is done with it: a late read would send the pattern
            release(blob, "the fast tier's part message")
        missing = [s for s in sources if sizes[s] <= 0]
        error = f"rank {me}: ranks {missing} had no part to copy" if missing else ""
        return {s: memoryview(t.numpy()) for s, t in boxes.items()}, error  # type: ignore[arg-type]

    def _retire(self) -> None:
        """Keep the newest :data:`KEEP` committed steps of this node; remove older ones and
        unfinished ones older than the newest committed (a killed save's)."""
        steps = self.steps()
        committed = sorted((s for s in steps if s.committed), key=lambda s: s.step)
        keep = {(s.step, s.run) for s in committed[-KEEP:]}
        newest = committed[-1].step if committed else -1
        for s in steps:
            if (s.step, s.run) in keep:
                continue
            if s.committed or s.step < newest or (s.step == newest and s.run != self.run):
                remove_fast_step(s)

    def forget_after(self, step: int) -> None:
        """A resume from ``step``: fast steps newer than it belong to a timeline that is
        gone (they would meet this run's next saves); remove them on this node."""
        for s in self.steps():
            if s.step > step:
                remove_fast_step(s)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._own_stager:
                self._snapshot.stager.close()
            if self._lease is not None:
                self._lease.release()
                self._lease = None

    # ---- restoring (sessions/fast_restore.py)

    def restorer(self) -> FastRestore:
        return FastRestore(
            comm=self.comm,
            nodes=self.nodes,
            root=self.root,
            process_group=self.process_group,
        )

    def choose(self, newer_than: int | None) -> Choice | None:
        """See :meth:`FastRestore.choose`."""
        return self.restorer().choose(newer_than)

    def fill(self, choice: Choice, tensors: Mapping[str, Any], started: float) -> RestoreInfo:
        """See :meth:`FastRestore.fill`."""
        return self.restorer().fill(choice, tensors, started)
