"""Which committed steps a :class:`~reshard_svc.CheckpointManager` keeps: a pure policy.

``keep_last=K`` keeps the newest K committed steps; ``keep_every=M`` also keeps every step
divisible by M (milestones, as Orbax's ``keep_period``); ``None`` for both keeps all. The
newest committed step is always kept: it is the resume point. Only the committed steps
passed in are ever named for deletion, so a step being written (not yet committed) or a
folder the manager did not name is never touched. What a step folder is on storage is
:mod:`reshard_svc.format.steps`'s.
"""

from __future__ import annotations

from collections.abc import Iterable

from reshard_svc.errors import UsageError

__all__ = ["check_policy", "retained"]


def check_policy(keep_last: int | None, keep_every: int | None) -> None:
    for what, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise UsageError(f"{what} must be a positive integer or None, got {value!r}")


def retained(committed: Iterable[int], keep_last: int | None, keep_every: int | None) -> set[int]:
    """The committed steps the policy keeps (the rest may be deleted)."""
    check_policy(keep_last, keep_every)
    steps = sorted(set(committed))
    if keep_last is None and keep_every is None:
        return set(steps)
    keep = set(steps[-keep_last:]) if keep_last is not None else set()
    if keep_every is not None:
        keep |= {s for s in steps if s % keep_every == 0}
    if steps:
        keep.add(steps[-1])
    return keep
