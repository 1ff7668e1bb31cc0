"""Step folders under a root: naming, listing, committed-or-not, retiring, leftovers.

A training job's checkpoints live one per step under a root: ``ROOT/step-0000000100/``,
each a checkpoint of ours, committed when its ``reshard.index.json`` lands. This module
owns what that means on storage; :class:`~reshard_svc.CheckpointManager` decides when to
save and which steps go (:mod:`reshard_svc.plan.retention`), and asks :class:`StepFolders`
to do it. Everything here goes through the storage protocols; what a backend leaves
beside a folder (its staging, its leases) is the backend's to name
(:meth:`~reshard_svc.storage.base.Committer.beside`).

Retiring a step is killed-anywhere safe: the index is first copied to a retirement record
(:data:`RETIRING`) and then removed (the step is no longer committed), then the files the
record lists go, then the record, then the folder if it is empty. The next
:meth:`StepFolders.collect` finishes a retirement killed midway. Nothing a step's index
does not list is ever deleted.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard_svc.errors import CheckpointError, StorageError
from reshard_svc.format.collect import collect
from reshard_svc.format.index import INDEX_NAME, CheckpointIndex
from reshard_svc.storage import open_storage
from reshard_svc.storage.base import Target

__all__ = [
    "RETIRING",
    "STEP_PATTERN",
    "StepFolders",
    "StepInfo",
    "parse_fast_step",
    "parse_step",
    "step_name",
]

logger = logging.getLogger(__name__)

#: Step folders are ``step-<digits>``: ours are zero-padded to 10 digits (they sort as
#: text); torchtitan's and DCP users' ``step-N`` parse too.
STEP_PATTERN = re.compile(r"step-(\d{1,18})")
_WIDTH = 10
#: A step being retired: a copy of its index, written before the index is removed, so
#: that a retirement killed midway is finished by the next (and only its files go).
RETIRING = ".reshard.retiring.json"


#: A fast step folder (the fast tier's, in a node's fast path): the step's name, then the
#: token of the run that saved it.
_FAST_STEP = re.compile(STEP_PATTERN.pattern + r"\.([0-9a-f]{8,32})")


def step_name(step: int, run: str | None = None) -> str:
    """The folder of ``step``: under the root, or (given the run's token) in a fast path."""
    name = f"step-{step:0{_WIDTH}d}"
    return name if run is None else f"{name}.{run}"


def parse_step(name: str) -> int | None:
    """The step of a step folder under a root, or None for any other name."""
    m = STEP_PATTERN.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_fast_step(name: str) -> tuple[int, str] | None:
    """The step and run token of a fast step folder, or None for any other name."""
    m = _FAST_STEP.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    """One step folder, of either tier: committed (its index, or the fast tier's commit
    record, exists) or partial. The one record the manager, the fast tier and
    ``reshard steps`` list."""

    step: int
    name: str
    committed: bool
    bytes: int
    #: seconds since its last change (the index, or the newest file), when the store says
    age_s: float | None
    #: a retirement of it was interrupted (the next retention finishes it)
    retiring: bool = False
    #: what the retention policy does with it: ``keep``, ``delete`` (also a partial step
    #: whose retirement was interrupted), or None (not asked, partial, or the fast tier's,
    #: which keeps its newest two itself)
    policy: str | None = None
    #: ``persistent`` (under the root) or ``fast`` (in a node's fast path)
    tier: str = "persistent"

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "name": self.name,
            "committed": self.committed,
            "bytes": self.bytes,
            "age_s": self.age_s,
            "policy": self.policy,
            "tier": self.tier,
        }


class StepFolders:
    """The step folders under ``root`` (any fsspec URI). Every method reads or changes
    storage; none of them raises for a folder that is not a step of ours."""

    def __init__(self, root: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.root = root.rstrip("/")
        self.storage_options = dict(storage_options or {})

    def uri(self, step: int) -> str:
        return f"{self.root}/{step_name(step)}"

    def storage(self, step: int) -> Target:
        return open_storage(self.uri(step), self.storage_options)

    def folders(self) -> dict[int, str]:
        """Step folders by step (the first name of each step, when two spell one)."""
        out: dict[int, str] = {}
        for name in open_storage(self.root, self.storage_options).listdir():
            step = parse_step(name)
            if step is not None:
                out.setdefault(step, name)
        return out

    def committed(self) -> list[int]:
        """Committed steps (their index exists), oldest first."""
        return [
            s for s, name in sorted(self.folders().items()) if self._open(name).exists(INDEX_NAME)
        ]

    def listing(self, *, sizes: bool = True) -> list[StepInfo]:
        """Every step folder, oldest first (read-only)."""
        rows = []
        now = time.time()
        for step, name in sorted(self.folders().items()):
            storage = self._open(name)
            files = storage.sizes() if sizes else {}
            committed = INDEX_NAME in files if sizes else storage.exists(INDEX_NAME)
            age = None
            if sizes and files:
                newest = INDEX_NAME if committed else max(files, key=lambda f: files[f])
                modified = storage.modified(newest)
                age = None if modified is None else max(0.0, now - modified)
            retiring = RETIRING in files if sizes else storage.exists(RETIRING)
            rows.append(
                StepInfo(
                    step=step,
                    name=name,
                    committed=committed,
                    bytes=sum(files.values()),
                    age_s=age,
                    retiring=retiring,
                )
            )
        return rows

    # ---- changing them

    def prepare(self) -> Target:
        """The root, made where the store has folders (its lease sits beside it)."""
        storage = open_storage(self.root, self.storage_options)
        storage.make_folder()
        return storage

    def retire(self, step: int) -> None:
        """Delete one committed step folder of ours (see the module doc); a failure is a
        warning, never raised."""
        storage = self.storage(step)
        try:
            raw = storage.read(INDEX_NAME)
            CheckpointIndex.loads(raw, f"{storage.uri}/{INDEX_NAME}")
            storage.write(RETIRING, raw)
            storage.remove(INDEX_NAME)
            _finish_retirement(storage)
            logger.info("retention: removed step %d (%s)", step, storage.uri)
        except (CheckpointError, StorageError, OSError) as e:
            logger.warning("retention: could not remove step %d at %s: %s", step, storage.uri, e)

    def finish_interrupted(self) -> None:
        """A dead job's commit that was decided (its index written) but not yet moved into
        place is finished, so the step it saved is the one a resume loads."""
        steps = set()
        for name, kinds in open_storage(self.root, self.storage_options).beside().items():
            step = parse_step(name)
            if step is not None and "run" in kinds:
                steps.add(step)
        for step in sorted(steps):
            target = self.storage(step)
            try:
                report = collect(target)
            except Exception as e:  # reported, never raised: the step stays uncommitted
                logger.warning("could not collect the leftovers of %s: %s", target.uri, e)
                continue
            if report.rolled_forward:
                logger.warning("finished the interrupted commit of step %d (%s)", step, target.uri)

    def collect(self, kept: set[int]) -> None:
        """What dead saves left: in step folders that never committed (stale leases only),
        the lease of a save killed before it made its folder (the lease comes first), the
        stale lease of a save killed after its commit, before it released the lease, and
        a retirement killed midway. Committed steps in ``kept`` with no lease beside them
        are not visited. Failures are warnings."""
        leased: dict[int, str] = {}
        for name, kinds in open_storage(self.root, self.storage_options).beside().items():
            step = parse_step(name)
            if step is not None and "lease" in kinds:
                leased[step] = name
        entries = {**leased, **self.folders()}  # a lease may sit where no folder is yet
        for step, name in sorted(entries.items()):
            if step in kept and step not in leased:
                continue
            storage = self._open(name)
            try:
                collect(storage)
                if storage.exists(RETIRING) and not storage.exists(INDEX_NAME):
                    _finish_retirement(storage)  # a retirement killed midway
                    logger.info("retention: finished removing step %d (%s)", step, name)
                storage.remove_folder()
            except Exception as e:  # reported, never raised
                logger.warning("could not collect the leftovers of %s: %s", storage.uri, e)

    # ---- helpers

    def _open(self, name: str) -> Target:
        return open_storage(f"{self.root}/{name}", self.storage_options)


def _finish_retirement(storage: Target) -> None:
    """Remove the files a retirement record lists, then the record, then the folder when
    it is empty."""
    raw = storage.read(RETIRING)
    index = CheckpointIndex.loads(raw, f"{storage.uri}/{RETIRING}")
    for name in index.files:
        storage.remove(name)  # a file already gone is no error
    storage.remove(RETIRING)
    storage.remove_folder()
