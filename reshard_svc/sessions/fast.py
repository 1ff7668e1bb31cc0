"""The fast tier of a :class:`~reshard_svc.CheckpointManager`: node memory and peer copies.

``FastTier(path, every=10, copies=2)`` makes the manager, every ``every`` steps, snapshot
each rank's shards (a copy into reused staging buffers: the stall) and, in the
background, on the manager's own gloo group:

1. write them as this rank's *part* under its node's fast path (our format: safetensors,
   a partial index, block CRC32Cs; :mod:`reshard_svc.format.fast`);
2. send the part to ``copies - 1`` ranks on other nodes, which check every block and
   publish it under their own node's fast path;
3. agree (one all-reduce) that every part has all its copies; then every rank writes the
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
import math
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from reshard_svc._process import fork_call
from reshard_svc.errors import CheckpointError, ReshardError, UsageError
from reshard_svc.format.fast import (
    FastStep,
    check_part,
    fast_step_name,
    fast_steps,
    local_root,
    make_step_folder,
    pack_part,
    part_folder,
    part_target,
    read_part,
    remove_fast_step,
    remove_part,
    unpack_part,
    write_commit,
)
from reshard_svc.jobs.environment import NODE_RANK_ENV, node_rank
from reshard_svc.layout import Box
from reshard_svc.plan.items import Held, Holdings
from reshard_svc.plan.save import plan_save
from reshard_svc.runtime.async_save import STOP_SIGNALS, can_fork
from reshard_svc.runtime.buffers import BackgroundWriter
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.save import WRITE_QUEUE_BYTES, saved_index, write_file
from reshard_svc.runtime.state_dict import LocalShard, LocalShards, flatten
from reshard_svc.runtime.targets import Placed, describe
from reshard_svc.runtime.transfer import transfer
from reshard_svc.storage import open_storage
from reshard_svc.storage.leases import Lease

__all__ = ["Choice", "FastSaves", "FastTier", "RestoreInfo"]

logger = logging.getLogger(__name__)

#: Fast steps each node keeps (committed); the one being written comes on top.
KEEP = 2
#: Rounds of choosing copies before a restore gives up on the fast tier (each round skips
#: the copies found bad).
ROUNDS = 4


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


@dataclass(frozen=True, kw_only=True)
class RestoreInfo:
    """Where a resume's state came from, on this rank: the step, the tier (``fast``,
    ``persistent`` or ``none``), the bytes of this rank's state read on its own node's fast
    path, on another node's, and from the persistent root, the wall time, and the fast
    copies skipped as bad."""

    step: int | None
    tier: str
    bytes_local: int
    bytes_peer: int
    bytes_persistent: int
    seconds: float
    skipped: tuple[str, ...] = ()
    #: seconds by phase (``find``: what each node holds and which step; ``check``: the
    #: CRC32Cs of the parts read; ``move``: reading them and moving them into place)
    phases: Mapping[str, float] = field(default_factory=dict)


# ---- the snapshot: this rank's boxes in reused host buffers


class _Snapshot:
    """This rank's tensors copied into staging buffers (reused from one save to the next),
    and its JSON values."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, Box], torch.Tensor] = {}
        self.placed: dict[str, Placed] = {}
        self.extras: dict[str, Any] = {}

    def take(self, state: Mapping[str, Any], views: bool = False) -> None:
        """Copy this rank's tensors into the staging buffers; with ``views``, contiguous
        CPU boxes stay the live views (a forked writer's copy-on-write memory holds them)."""
        placed: dict[str, Placed] = {}
        extras: dict[str, Any] = {}
        used = set()
        for name, leaf in flatten(state).items():
            if leaf.kind == "extra":
                extras[name] = json.loads(json.dumps(leaf.value))
                continue
            live = describe(leaf)
            copy = Placed(name=name, dtype=live.dtype, shape=live.shape, layout=live.layout)
            for box, view in live.local.items():
                if views and view.device.type == "cpu" and view.is_contiguous():
                    copy.local[box] = view.detach()
                    continue
                key = (name, box)
                buf = self.buffers.get(key)
                if buf is None or buf.dtype != view.dtype or buf.shape != view.shape:
                    buf = self.buffers[key] = torch.empty(
                        tuple(view.shape), dtype=view.dtype, device="cpu"
                    )
                buf.copy_(view.detach())
                copy.local[box] = buf
                used.add(key)
            placed[name] = copy
        for key in set(self.buffers) - used:
            del self.buffers[key]
        self.placed, self.extras = placed, extras


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

    def __init__(self, tier: FastTier, comm: Comm, process_group: Any) -> None:
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
        self._group = None
        if dist.is_available() and dist.is_initialized():
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        self._global = dist.get_process_group_ranks(self._group) if self._group is not None else [0]
        self._bg = Comm(self._group)  # the background thread's agreements
        self._lease: Lease | None = None
        try:
            comm.run_everywhere(f"FastTier({tier.path!r}): taking the fast path", self._take)
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            if self._group is not None:
                dist.destroy_process_group(self._group)
            raise
        self._snapshot = _Snapshot()
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

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Every rank: wait for the fast save in flight, snapshot, and write in the
        background."""
        self.wait()
        if step == self._counted:
            return  # this run's fast step of this number already counts (a forced save)
        leaves = [describe(leaf) for leaf in flatten(state).values() if leaf.kind != "extra"]
        fork = can_fork(v for p in leaves for v in p.local.values())
        self._snapshot.take(state, views=fork)
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
        """The background part of a fast save (every rank, on the fast tier's group):
        whether the step counts, and the step."""
        return self._write_step(step, prepared), step

    def _write_step(self, step: int, prepared: Callable[[], Any] | str | None) -> bool:
        folder = f"{self.root}/{fast_step_name(step, self.run)}"
        error = ""
        blob = bytearray()
        try:
            if isinstance(prepared, str):
                raise CheckpointError(prepared)
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
        if self._group is None or (not to and not sources):
            return {}, ""
        size = torch.tensor([len(blob) if blob is not None else -1], dtype=torch.int64)
        sizes = {s: torch.zeros(1, dtype=torch.int64) for s in sources}
        ops = [dist.P2POp(dist.isend, size, self._global[r], self._group) for r in to]
        ops += [dist.P2POp(dist.irecv, sizes[s], self._global[s], self._group) for s in sources]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        payload = torch.frombuffer(blob, dtype=torch.uint8) if blob else None
        boxes = {s: torch.empty(int(sizes[s]), dtype=torch.uint8) for s in sources if sizes[s] > 0}
        ops = []
        if payload is not None:
            ops += [dist.P2POp(dist.isend, payload, self._global[r], self._group) for r in to]
        ops += [dist.P2POp(dist.irecv, t, self._global[s], self._group) for s, t in boxes.items()]
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
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
            if self._lease is not None:
                self._lease.release()
                self._lease = None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    # ---- restoring

    def choose(self, newer_than: int | None) -> Choice | None:
        """Every rank: the newest whole fast step not older than ``newer_than`` (the
        persistent root's newest: the fast tier wins a tie), with which rank reads which part, every block of those parts
        checked (a bad copy is skipped for another, named in one warning); None when no
        fast step qualifies."""
        bad: set[tuple[int, str, int]] = set()  # (node, step folder, origin rank)
        skipped: list[str] = []
        phases = {"find": 0.0, "check": 0.0}
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            _, reports = self.comm.run_everywhere("fast tier: what each node holds", self._report)
            choice = _choose(reports, bad, newer_than)
            t1 = time.perf_counter()
            phases["find"] += t1 - t0
            if choice is None:
                return None
            mine = [o for o, r in choice.readers.items() if r == self.comm.rank]
            problems = self._checked(choice, mine)
            phases["check"] += time.perf_counter() - t1
            choice.phases = phases
            found = [
                (self.nodes[r], choice.name, int(o), text)
                for r, p in enumerate(problems)
                for o, text in p
            ]
            if not found:
                choice.skipped = tuple(skipped)
                return choice
            for node, folder, origin, text in found:
                bad.add((node, folder, origin))
                skipped.append(f"node {node}: rank {origin}'s part of {folder}: {text}")
            logger.warning(
                "fast tier: skipping bad copies, using others: %s",
                "; ".join(skipped[-len(found) :]),
            )
        return None

    def fill(self, choice: Choice, tensors: Mapping[str, Any], started: float) -> RestoreInfo:
        """Every rank: move the chosen step's bytes into ``tensors`` (this job's layout)."""
        mine = [o for o, r in choice.readers.items() if r == self.comm.rank]
        t0 = time.perf_counter()
        src, boxes = self._sources(choice.name, mine)
        moved = transfer(src, tensors, process_group=self.process_group, plan_cache=None)
        phases = {**choice.phases, "move": time.perf_counter() - t0}
        logger.info(
            "fast tier: restored step %d in %.2f s (%s; this rank sent %d B, received %d B)",
            choice.step,
            time.perf_counter() - started,
            ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()),
            moved.bytes_sent,
            moved.bytes_received,
        )
        by_node = _bytes_by_node(tensors, boxes, self.comm, self.nodes)
        return RestoreInfo(
            step=choice.step,
            tier="fast",
            bytes_local=by_node.get(self.node, 0),
            bytes_peer=sum(v for n, v in by_node.items() if n != self.node),
            bytes_persistent=0,
            seconds=time.perf_counter() - started,
            skipped=choice.skipped,
            phases=phases,
        )

    def _checked(self, choice: Choice, mine: list[int]) -> list[Any]:
        """Every rank's bad parts among those it will read: [[origin, why], ...] each."""

        def share(_: None) -> list[tuple[int, str]]:
            return self._check_parts(choice.name, mine)

        return self.comm.run_everywhere(
            f"fast tier: checking the copies of step {choice.step}", lambda: None, share=share
        )[1]

    def _report(self) -> dict[str, Any]:
        """What this node's fast path holds: committed steps, their parts and boxes."""
        out: dict[str, Any] = {"node": self.node, "steps": {}}
        for s in self.steps():
            if not s.committed:
                continue
            parts = {}
            for origin, folder in s.parts.items():
                try:
                    index = read_part(folder)
                except ReshardError:
                    continue  # an unreadable index: this copy does not count
                parts[str(origin)] = {
                    "bytes": sum(f.size for f in index.files.values()),
                    "boxes": {
                        n: [[list(c.box.offsets), list(c.box.sizes)] for c in t.chunks]
                        for n, t in index.tensors.items()
                    },
                    "extras": index.extras,
                }
            out["steps"][s.name] = {"record": s.record, "parts": parts}
        return out

    def _check_parts(self, name: str, origins: list[int]) -> list[tuple[int, str]]:
        """Check every block of the parts this rank will read; the bad ones, with why."""
        bad = []
        for origin in origins:
            try:
                check_part(part_folder(f"{self.root}/{name}", origin))
            except (ReshardError, OSError) as e:
                bad.append((origin, str(e)))
        return bad

    def _sources(
        self, name: str, origins: list[int]
    ) -> tuple[dict[str, LocalShards], dict[str, list[Box]]]:
        """The parts this rank reads, as transfer sources: memory maps of the node's files
        (checked; nothing is copied until sent), each distinct box once."""
        shards: dict[str, list[LocalShard]] = {}
        seen: set[tuple[str, Box]] = set()
        for origin in origins:
            folder = part_folder(f"{self.root}/{name}", origin)
            index = read_part(folder)
            storage = open_storage(folder, {"sync_files": False})
            for tname, meta in index.tensors.items():
                for c in meta.chunks:
                    if (tname, c.box) in seen:
                        continue
                    seen.add((tname, c.box))
                    if c.end > c.begin:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")  # a read-only map, never written
                            data = torch.frombuffer(
                                storage.read_view(c.file, c.begin, c.end), dtype=meta.dtype
                            )
                    else:
                        data = torch.empty(0, dtype=meta.dtype)
                    shard = LocalShard(data.view(c.box.sizes), meta.shape, c.box.offsets)
                    shards.setdefault(tname, []).append(shard)
        boxes = {n: [Box(s.offsets, tuple(s.tensor.shape)) for s in v] for n, v in shards.items()}
        return {n: LocalShards(tuple(v)) for n, v in shards.items()}, boxes


@dataclass(kw_only=True)
class Choice:
    """A fast step to restore: its step and folder name, which rank reads which origin
    rank's part, the tensor names and JSON values it holds, and the bad copies skipped."""

    step: int
    name: str
    readers: dict[int, int]
    names: set[str]
    extras: dict[str, Any]
    skipped: tuple[str, ...] = ()
    phases: dict[str, float] = field(default_factory=dict)


def _choose(
    reports: list[dict[str, Any]], bad: set[tuple[int, str, int]], newer_than: int | None
) -> Choice | None:
    """The newest committed fast step (not older than ``newer_than``) whose every byte has a
    good copy on some node, and which rank reads which part. Each distinct box is read
    once: a part is read only when it holds a box no earlier part holds, by the rank of
    its number when that rank's node has it, else by the least loaded rank of a node that
    has it."""
    holders: dict[str, dict[int, list[int]]] = {}  # folder -> origin -> ranks that may read it
    records: dict[str, dict[str, Any]] = {}
    parts: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, report in enumerate(reports):
        node = report["node"]
        for name, held in report["steps"].items():
            records.setdefault(name, held["record"])
            for origin, part in held["parts"].items():
                if (node, name, int(origin)) in bad:
                    continue
                holders.setdefault(name, {}).setdefault(int(origin), []).append(rank)
                parts.setdefault(name, {})[int(origin)] = part
    candidates = []
    for name, record in records.items():
        step = int(record.get("step", -1))
        if (newer_than is None or step >= newer_than) and _whole(record, parts.get(name, {})):
            candidates.append((step, float(record.get("time", 0)), name))
    if not candidates:
        return None
    step, _, name = max(candidates)
    load = [0] * len(reports)
    readers: dict[int, int] = {}
    covered: set[Any] = set()
    names: set[str] = set()
    extras: dict[str, Any] = {}
    for origin in sorted(parts[name]):
        part = parts[name][origin]
        names |= set(part["boxes"])
        for key, value in part["extras"].items():
            extras.setdefault(key, value)
        boxes = {(t, tuple(map(tuple, b))) for t, bs in part["boxes"].items() for b in bs}
        if not boxes - covered:
            continue  # replicas of what earlier parts hold: not read
        covered |= boxes
        # the rank of the same number reads its own part when its node has it (a restart
        # at the same size then moves nothing); else the least loaded rank that may
        can = holders[name][origin]
        rank = origin if origin in can else min(can, key=lambda r: (load[r], r))
        load[rank] += int(part["bytes"])
        readers[origin] = rank
    return Choice(step=step, name=name, readers=readers, names=names, extras=extras)


def _whole(record: Mapping[str, Any], parts: Mapping[int, Mapping[str, Any]]) -> bool:
    """Whether the parts at hand hold every byte of every tensor the step saved (boxes of
    one layout either coincide, as replicas, or do not overlap)."""
    shapes = record.get("tensors")
    if not isinstance(shapes, dict):
        return False
    distinct: dict[str, set[Any]] = {}
    for part in parts.values():
        for t, bs in part["boxes"].items():
            distinct.setdefault(t, set()).update((tuple(o), tuple(s)) for o, s in bs)
    for t, shape in shapes.items():
        total = math.prod(shape)
        have = sum(math.prod(s) for _, s in distinct.get(t, ()))
        if have != total:
            return False
    return True


def _bytes_by_node(
    tensors: Mapping[str, Any], boxes: dict[str, list[Box]], comm: Comm, nodes: list[int]
) -> dict[int, int]:
    """Bytes of this rank's state by the node they were read on: every rank says which
    boxes it read, and each of this rank's boxes is matched against them."""
    mine = {n: [[list(b.offsets), list(b.sizes)] for b in bs] for n, bs in boxes.items()}
    _, every = comm.run_everywhere("fast tier: who read what", lambda: None, share=lambda _: mine)
    out: dict[int, int] = {}
    for name, leaf in flatten(tensors).items():
        if leaf.kind == "extra":
            continue
        held = describe(leaf)
        for rank, read in enumerate(every):
            for o, s in read.get(name, []):
                src = Box(tuple(o), tuple(s))
                for box in held.local:
                    inter = box.intersect(src)
                    if inter is not None and not inter.is_empty:
                        n = inter.numel * held.dtype.itemsize
                        out[nodes[rank]] = out.get(nodes[rank], 0) + n
    return out
