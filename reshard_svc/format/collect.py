"""A run's hold on its target, and collecting what interrupted runs left.

:class:`TargetRun` is a save's or convert's coordinator holding its target: it takes the
target's lease (:mod:`reshard_svc.storage.leases`: one owner at a time, a second run fails
at once with :class:`~reshard_svc.errors.TargetBusyError`), checks the target under it,
clears what dead runs left, and then commits or aborts; the commit is the lease holder's
alone (``confirm`` runs right before it).

What dead runs leave:

* local folders: ``.<name>.staging-<token>`` (data not yet committed, or a commit decided
  but not finished) and ``.<name>.old-<token>`` (the checkpoint being replaced);
* object stores: data files named ``*-<token[:12]>.safetensors`` that the index does not
  name, and, after an interrupted overwrite, the replaced checkpoint's files.

:func:`collect` (``reshard gc``) removes them. The run named by a stale lease (expired, its
process gone, or held by the ``owner`` the caller names) was the owner of record: a
commit it decided is finished, a half-swapped one rolled back. Any other run never held
the lease at its end, so it is never rolled forward: its data files are removed and
nothing of it appears in the target. A live lease's run is never touched, and files that
are not part of a checkpoint are never deleted.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from reshard_svc.errors import CheckpointError
from reshard_svc.format.hf import HF_INDEX, model_weights
from reshard_svc.format.index import INDEX_NAME, CheckpointIndex
from reshard_svc.format.target import check_target
from reshard_svc.storage import open_storage
from reshard_svc.storage.base import CollectReport, LeaseState, LeaseStore, Storage, Target
from reshard_svc.storage.leases import Lease, LeaseRecord, parse

__all__ = ["GcReport", "TargetRun", "collect", "collect_lease_debris", "replaced_files"]

logger = logging.getLogger(__name__)


def replaced_files(storage: Storage, model_folder: bool = False) -> set[str]:
    """The files a commit at ``storage`` replaces: the committed checkpoint's data files
    and index (and its HF index, if it is an HF export); into a model folder
    (``model_folder``), its weight files too. Empty when nothing is committed."""
    files = model_weights(storage) if model_folder else set()
    if not storage.exists(INDEX_NAME):
        return files
    try:
        index = CheckpointIndex.loads(storage.read(INDEX_NAME))
    except CheckpointError:
        return files | {INDEX_NAME}
    files |= set(index.files) | {INDEX_NAME}
    if index.tensors and all(t.layout is None for t in index.tensors.values()):
        files.add(HF_INDEX)  # an HF export: its model.safetensors.index.json is ours
    return files


@dataclass(kw_only=True)
class GcReport(CollectReport):
    uri: str = ""
    live: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def __bool__(self) -> bool:
        return bool(self.removed or self.rolled_forward or self.rolled_back)


def _collect_holder(
    target: Target, holder: LeaseRecord | None, report: CollectReport, dry_run: bool
) -> None:
    """Finish or clear what the stale lease's run (the owner of record) left."""
    if holder is None:
        return
    current = replaced_files(target)
    replaced = set(holder.replaces) if holder.replaces else None
    target.collect_run(holder.token, replaced, current, report, owner=True, dry_run=dry_run)


def _collect_orphans(target: Target, keep: set[str], report: CollectReport, dry_run: bool) -> None:
    """Clear the leftovers of runs that did not hold the lease at their end (and, on local
    folders, lease records a dead process was renewing)."""
    current = replaced_files(target)
    for token in sorted(target.runs()):
        if token in keep or any(k.startswith(token) for k in keep):
            continue
        target.collect_run(token, None, current, report, owner=False, dry_run=dry_run)
    collect_lease_debris(target, report, dry_run)


def collect_lease_debris(
    target: LeaseStore, report: CollectReport | None = None, dry_run: bool = False
) -> None:
    """Remove what lease operations of dead processes left beside ``target``'s lease (on
    local folders: a renewal's record not yet renamed, a lease renamed aside by a release
    or takeover and not yet removed). A live process's are never touched."""
    removed = target.remove_lease_debris(dry_run)
    if report is not None:
        report.removed += removed


class TargetRun:
    """The coordinator's hold on a save's or convert's target: it takes the lease (or
    raises :class:`TargetBusyError`), checks the target under it, collects what dead runs
    left, and then commits or aborts.

    ``model_folder``: the target may be a Hugging Face model folder (an HF export): its
    config, tokenizer and other files stay; existing weights are replaced only with
    ``overwrite``. Created by rank 0 only, before any rank writes a data file.
    """

    def __init__(
        self, storage: Target, kind: str, overwrite: bool = False, model_folder: bool = False
    ) -> None:
        self.storage = storage
        self.token = uuid.uuid4().hex

        def on_stale(holder: LeaseRecord | None, state: LeaseState) -> None:
            _collect_holder(self.storage, holder, CollectReport(), dry_run=False)

        self.lease = Lease.acquire(storage, storage.uri, self.token, kind, on_stale)
        try:
            # under the lease: nobody commits meanwhile
            check_target(storage, overwrite, model_folder)
            try:
                _collect_orphans(storage, {self.token}, CollectReport(), dry_run=False)
            except Exception:  # housekeeping never fails the run itself
                logger.warning("could not collect leftovers at %s", storage.uri, exc_info=True)
            self.replaced = replaced_files(storage, model_folder)
        except BaseException:
            self.lease.release()
            raise

    def commit(self, staging: Storage, index_bytes: bytes) -> None:
        """Make the new checkpoint visible, if this run still holds the lease; on failure
        nothing half-done is left visible and nothing is deleted that a collection would
        need to finish the commit."""
        try:
            self.lease.replacing(self.replaced)  # confirms the lease is still ours
            self.storage.commit(staging, index_bytes, self.replaced)
        except BaseException:
            self.abort(staging)
            raise
        self.lease.release(remove=not self.storage.pending(self.token))

    def abort(self, staging: Storage) -> None:
        try:
            self.storage.abort(staging)
        finally:
            self.lease.release(remove=not self.storage.pending(self.token))


def collect(
    target: str | Target,
    *,
    owner: str | None = None,
    dry_run: bool = False,
    storage_options: Any = None,
) -> GcReport:
    """Remove what interrupted saves and converts into ``target`` left behind.

    The run whose lease is stale (or held by ``owner``) is finished or cleared as the owner
    of record; other runs' leftovers are removed and never rolled forward; a live lease's
    run is left alone. ``dry_run`` reports what would be done and changes nothing.
    """
    storage: Target = (
        target if not isinstance(target, str) else open_storage(target, storage_options)
    )
    report = GcReport(uri=storage.uri)
    state = storage.read_lease()
    holder = parse(state)
    keep: set[str] = set()
    if (
        state is not None
        and holder is not None
        and not holder.stale(time.time(), state.modified, owner)
    ):
        report.live.append(holder.token)
        keep.add(holder.token)
    elif state is not None:
        _collect_holder(storage, holder, report, dry_run)
        if holder is not None:
            keep.add(holder.token)  # collected above, as the owner
        report.removed.append(storage.lease_path())
        if not dry_run:
            storage.drop_lease(state.version)
    _collect_orphans(storage, keep, report, dry_run)
    if report:
        logger.info(
            "gc %s: removed %d, rolled forward %d, rolled back %d",
            storage.uri,
            len(report.removed),
            len(report.rolled_forward),
            len(report.rolled_back),
        )
    return report
