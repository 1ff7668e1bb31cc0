"""What a training root holds, and a node's fast path: ``reshard steps``, read-only.

:func:`list_steps` lists every step folder under a root (committed or partial, size, age)
and what a retention policy would keep, and, given a node's fast path, the fast steps it
holds. Nothing is deleted here; :class:`~reshard_svc.CheckpointManager` retires steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from reshard_svc.format.fast import fast_steps
from reshard_svc.format.steps import StepFolders, StepInfo
from reshard_svc.plan.retention import check_policy, retained

__all__ = ["StepInfo", "list_steps"]


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
    fast_rows = [s.info(sizes) for s in (fast_steps(fast) if fast is not None else [])]
    persistent = [
        dataclasses.replace(
            r,
            policy=(
                ("keep" if r.step in keep else "delete")
                if r.committed
                else ("delete" if r.retiring else None)
            ),
        )
        for r in rows
    ]
    return sorted([*persistent, *fast_rows], key=lambda r: (r.step, r.tier != "persistent"))
