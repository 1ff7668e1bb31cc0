"""``load``: fill the caller's DTensors / Tensors in place from any checkpoint layout.

Every rank calls :func:`load` with the keys it wants (pipeline stages want their own
layers). Rank 0 opens the checkpoint (index or headers) and shares its description; one
all-gather tells every rank who wants which boxes; every rank computes the same read
plan; each needed stored byte is read by exactly one rank and the rest moves by
``all_to_all`` (gloo on CPU, NCCL on CUDA) on the one executor.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc.errors import CheckpointError, MissingFileError, StateDictError
from reshard_svc.format.index import FORMAT_NAME, INDEX_NAME, CheckpointIndex
from reshard_svc.format.readers import open_checkpoint
from reshard_svc.format.values import StoredValues, opaque_in
from reshard_svc.plan.budget import Budget
from reshard_svc.plan.budget import io_threads as count_io_threads
from reshard_svc.plan.items import Piece, Wave
from reshard_svc.plan.read import ReadPlan, StorageCost, choose_plan, warn_if_over_budget
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.executor import Progress, execute
from reshard_svc.runtime.reading import StorageSource
from reshard_svc.runtime.state_dict import flatten
from reshard_svc.runtime.targets import Placed, describe, gather
from reshard_svc.storage import Storage, open_storage

__all__ = ["LoadStats", "load", "open_shared"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LoadStats:
    """What :func:`load` did on this rank: the bytes it fetched from storage (CRC32C blocks
    are read whole) against the bytes it was planned to read, the size of every tensor
    loaded, the waves, and the read strategy that ran."""

    bytes_read: int  # fetched by this rank from storage (CRC blocks are read whole)
    bytes_total: int  # size of the loaded tensors in the checkpoint
    waves: int
    bytes_planned: int = 0  # the needed bytes this rank was planned to read
    strategy: str = ""  # the read strategy that ran (``auto`` picks one)


def open_shared(
    uri: str, comm: Comm, storage_options: Mapping[str, Any] | None = None
) -> tuple[Storage, CheckpointIndex]:
    """Every rank gets the same validated index of the checkpoint at ``uri``.

    A native checkpoint's index is read and parsed by every rank at once (rank 0 also
    checks its geometry and the files), and the ranks compare digests of what they read.
    A foreign folder is described by rank 0 alone (it reads file headers) and shared.
    """
    storage = open_storage(uri, storage_options)
    parsed: dict[str, CheckpointIndex] = {}

    def opener() -> Any:
        if comm.rank == 0:
            _, index = open_checkpoint(storage)
            parsed["index"] = index
            if comm.world == 1:
                return {"alone": True}
            if index.source != FORMAT_NAME:
                return {"index": index.to_json(), "source": index.source}
            raw = storage.read(INDEX_NAME)
            return {"digest": hashlib.sha256(raw).hexdigest()}
        try:
            raw = storage.read(INDEX_NAME)
        except MissingFileError:
            return {}  # a foreign folder (or none): rank 0 describes it
        parsed["index"] = CheckpointIndex.loads(raw, f"{uri}/{INDEX_NAME}")
        return {"digest": hashlib.sha256(raw).hexdigest()}

    _, results = comm.run_everywhere(f"opening checkpoint {uri}", opener)
    first = results[0]
    if comm.world == 1:
        return storage, parsed["index"]
    if "index" in first:
        if comm.rank == 0:
            return storage, parsed["index"]
        index = CheckpointIndex.from_json(first["index"], uri)
        index.source = first["source"]
        return storage, index
    if any(r.get("digest") != first["digest"] for r in results):
        raise CheckpointError(
            f"{uri}: ranks read different {INDEX_NAME} files (was the checkpoint replaced "
            "while opening it, or do the ranks see different storage?)"
        )
    return storage, parsed["index"]


def load(
    state_dict: Mapping[str, Any],
    uri: str,
    *,
    process_group: Any = None,
    strict: bool = True,
    max_memory: int | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    strategy: str = "auto",
    io_threads: int | str | None = None,
) -> LoadStats:
    """Load a checkpoint into ``state_dict`` in place, whatever the layouts on either side.

    Every rank passes the keys it wants (they may differ between ranks: pipeline stages
    pass their own layers). ``strict`` (default) raises :class:`StateDictError` when a
    requested key is missing from the checkpoint; ``strict=False`` skips it. Checkpoint
    keys that no rank asks for are not read. Non-tensor entries are replaced by the stored
    JSON values; a :class:`~reshard_svc.runtime.state_dict.LocalShard`'s padding is filled
    with its ``pad`` value.

    ``strategy="exchange"`` reads each needed stored byte once and moves the rest over
    the process group; ``"direct"`` lets every rank read what it needs itself (faster on
    a local page cache for replicated targets, more storage traffic). ``"auto"``
    (default) plans both and runs the cheaper under the storage's cost model
    (:class:`~reshard_svc.plan.cost.StorageCost`); off local files it keeps read-once.
    ``io_threads`` reads this rank's local files on that many threads at once, each
    checking the blocks it read (default: ``RESHARD_IO_THREADS``, else from the host).
    """
    threads = count_io_threads(io_threads)  # a bad count is refused before anything
    comm = Comm(process_group)
    storage, index = open_shared(uri, comm, storage_options)

    def match() -> tuple[dict[str, Any], None]:
        values = StoredValues(index, storage, comm.rank)
        return {"load": _match(state_dict, index, uri, strict, values)}, None

    got = gather(comm, f"load({uri!r}): matching keys", match)
    placed, holdings = got.mine["load"], got.holdings["load"]
    budget = Budget.of(max_memory, "load")
    warn_if_over_budget(index, holdings, budget)
    wanted = {n: h.held for n, h in holdings.items()}
    plan = choose_plan(index, wanted, comm.world, budget, strategy, StorageCost.of(storage))
    dtypes = {n: m.dtype for n, m in index.tensors.items()}
    source = StorageSource(storage, dtypes, comm.rank, index.block_tables(), io_threads=threads)
    with torch.no_grad():
        read = execute(plan, source, comm, _IntoStateDict(plan, placed), progress=progress)
        for p in placed.values():
            p.fill_padding()
    return LoadStats(
        bytes_read=read,
        bytes_total=sum(index.tensors[n].nbytes for n in placed),
        waves=len(plan.waves),
        bytes_planned=plan.bytes_read()[comm.rank],
        strategy=plan.strategy,
    )


def _match(
    state_dict: Mapping[str, Any],
    index: CheckpointIndex,
    uri: str,
    strict: bool,
    values: StoredValues,
) -> dict[str, Placed]:
    """Pair this rank's leaves with the checkpoint: non-tensor values are filled in place
    (:mod:`reshard_svc.format.values`: JSON extras, plain values of pickled items), keys
    checked (``strict``), and each tensor described as boxes this rank holds."""
    leaves = flatten(state_dict)  # type: ignore[arg-type]
    tensor_keys = {k for k, v in leaves.items() if v.kind != "extra"}
    found: dict[str, Any] = {}
    opaque: list[str] = []
    values.prepare(set(leaves) - tensor_keys)
    for name in sorted(set(leaves) - tensor_keys):
        ok, value = values.get(name, like=leaves[name].value)
        if not ok:
            continue
        hidden = opaque_in(value)
        if hidden is not None:
            opaque.append(
                f"{name!r} is stored as a pickled object of type {hidden.type_name} (not plain "
                f"data, so never unpickled here): read it with reshard_svc.read_blob({uri!r}, "
                f"{hidden.blob!r})"
            )
        else:
            found[name] = value
    missing = sorted((tensor_keys - set(index.tensors)) | (set(leaves) - tensor_keys - set(found)))
    if strict and opaque:
        raise StateDictError(f"load({uri!r}): " + "; ".join(opaque[:4]))
    if strict and missing:
        raise StateDictError(
            f"load({uri!r}): missing from the checkpoint: {_names(missing)} (pass "
            "strict=False to load the rest)"
        )
    placed: dict[str, Placed] = {}
    casts: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for name in sorted(tensor_keys & set(index.tensors)):
        placed[name] = p = _place(name, leaves[name], index.tensors[name])
        if p.dtype != index.tensors[name].dtype:
            casts.setdefault((index.tensors[name].dtype, p.dtype), []).append(name)
    for name, value in found.items():
        leaves[name].parent[leaves[name].key] = value
    for (stored, wanted), names in casts.items():
        logger.warning(
            "load(%r): casting %d tensor(s) stored as %s to %s (e.g. %r)",
            uri,
            len(names),
            stored,
            wanted,
            names[0],
        )
    return placed


def _place(name: str, leaf: Any, meta: Any) -> Placed:
    """One state-dict tensor as boxes this rank holds; refuses meta tensors and shapes
    that differ from the checkpoint's."""
    value = leaf.value
    local = getattr(value, "tensor", None) if leaf.kind == "local" else value
    local = getattr(local, "_local_tensor", local)
    if getattr(value, "is_meta", False) or getattr(local, "is_meta", False):
        raise StateDictError(
            f"{name!r} is a meta tensor, which has no storage to load into: "
            "materialize the model first (e.g. model.to_empty(device=...))"
        )
    p = describe(leaf)
    if p.shape != meta.shape:
        raise StateDictError(
            f"{name!r}: state_dict has shape {list(p.shape)} but the checkpoint "
            f"has {list(meta.shape)}"
        )
    return p


class _IntoStateDict:
    """``load``'s destination: the caller's own tensors (their local shards)."""

    def __init__(self, plan: ReadPlan, placed: dict[str, Placed]) -> None:
        self.targets, self.placed = plan.targets, placed

    def view(self, piece: Piece) -> torch.Tensor:
        t = self.targets[piece.target]
        return self.placed[t.tensor].local[t.box][piece.box.slices_in(t.box)]

    def take(self, piece: Piece, data: torch.Tensor) -> bool:
        return False  # always copied into the caller's tensor

    def wave_done(self, wave: Wave) -> None:
        pass


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
