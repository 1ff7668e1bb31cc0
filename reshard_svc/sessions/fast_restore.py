"""Restoring from the fast tier: which step, which rank reads which copy, and moving it.

Every rank asks what its node's fast path holds (one all-gather of small JSON); all agree
on the newest committed fast step whose every byte survives in a good copy (not older
than the persistent root's newest); each needed part is read once, by a rank on a node
that holds it, checked block by block (a bad copy is skipped for another, named in one
warning); then :func:`~reshard_svc.transfer` moves the bytes into the new job's layout.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard_svc.errors import ReshardError
from reshard_svc.format.fast import check_part, fast_steps, part_folder, read_part
from reshard_svc.layout import Box
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.state_dict import LocalShard, LocalShards, flatten
from reshard_svc.runtime.targets import describe
from reshard_svc.runtime.transfer import transfer
from reshard_svc.storage import open_storage

__all__ = ["Choice", "FastRestore", "RestoreInfo"]

logger = logging.getLogger(__name__)

#: Rounds of choosing copies before a restore gives up on the fast tier (each round skips
#: the copies found bad).
ROUNDS = 4


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


class FastRestore:
    """One restore's view of the fast tier: the job's comm, every rank's node, this
    node's fast path and the process group to move the bytes on. Every rank builds one."""

    def __init__(self, *, comm: Comm, nodes: list[int], root: str, process_group: Any) -> None:
        self.comm, self.nodes, self.root = comm, nodes, root
        self.node = nodes[comm.rank]
        self.process_group = process_group

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
        for s in fast_steps(self.root):
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
