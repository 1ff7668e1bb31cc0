"""What a training root holds, and a node's fast path: ``reshard steps``, read-only.

:func:`list_steps` lists every step folder under a root (committed or partial, size, age)
and what a retention policy would keep, and, given a node's fast path, the fast steps it
holds. Nothing is deleted here; :class:`~reshard_svc.CheckpointManager` retires steps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard_svc.format.fast import fast_steps
from reshard_svc.format.steps import StepFolders
from reshard_svc.plan.retention import check_policy, retained

__all__ = ["StepInfo", "list_steps"]


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    """One step folder under a root: committed (its index exists) or partial."""

    step: int
    name: str
    committed: bool
    bytes: int
    #: seconds since its last change (the index, or the newest file), when the store says
    age_s: float | None
    #: what the retention policy does with it: ``keep``, ``delete`` (also a partial step
    #: whose retirement was interrupted: the next retention finishes it), or None (partial,
    #: or the fast tier's, which keeps its newest two itself)
    policy: str | None
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


def list_steps(
    root: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    sizes: bool = True,
    fast: str | None = None,
) -> list[StepInfo]:
    """Every step folder under ``root``, oldest first, and what a retention policy of
    ``keep_last`` / ``keep_every`` would keep (read-only: nothing is deleted); with
    ``fast`` (a node's fast path), the fast steps it holds too."""
    check_policy(keep_last, keep_every)
    rows = StepFolders(root, storage_options).listing(sizes=sizes)
    keep = retained([r.step for r in rows if r.committed], keep_last, keep_every)
    now = time.time()
    fast_rows = [
        StepInfo(
            step=s.step,
            name=s.name,
            committed=s.committed,
            bytes=s.nbytes() if sizes else 0,
            age_s=max(0.0, now - float(s.record.get("time", now))) if s.record else None,
            policy=None,
            tier="fast",
        )
        for s in (fast_steps(fast) if fast is not None else [])
    ]
    persistent = [
        StepInfo(
            step=r.step,
            name=r.name,
            committed=r.committed,
            bytes=r.bytes,
            age_s=r.age_s,
            policy=(
                ("keep" if r.step in keep else "delete")
                if r.committed
                else ("delete" if r.retiring else None)
            ),
        )
        for r in rows
    ]
    return sorted([*persistent, *fast_rows], key=lambda r: (r.step, r.tier != "persistent"))
