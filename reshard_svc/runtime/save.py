"""``save``: every rank of a job writes its share of a state dict; rank 0 commits.

Order of events (every rank calls :func:`save`, each with the keys it holds: pipeline
stages pass their own layers):

1. rank 0 takes the target's lease; each rank describes its tensors, and one all-gather
   gives every rank every tensor's holders (:func:`~reshard_svc.runtime.targets.gather`);
2. each rank streams the boxes it was assigned into safetensors files in the staging
   area, computing block CRC32Cs as it writes, and the CRC32C of every box it holds that
   another rank holds too;
3. replicas must agree: if two holders of one box hold different bytes, every rank
   raises :class:`~reshard_svc.errors.ReplicaMismatchError` and nothing is committed;
4. rank 0 writes ``reshard.index.json`` and commits (rename locally, index-last on object
   stores). Any failure on any rank aborts the staging area on every path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch

from reshard_svc._version import __version__
from reshard_svc.errors import CheckpointError, ReplicaMismatchError, StateDictError
from reshard_svc.format.checksums import DEFAULT_BLOCK_SIZE, HashingWriter, check_algorithm
from reshard_svc.format.collect import TargetRun
from reshard_svc.format.index import CheckpointIndex, FileMeta, TensorMeta
from reshard_svc.format.safetensors import dtype_from_name, st_code
from reshard_svc.layout import Box, Layout
from reshard_svc.plan.budget import io_threads
from reshard_svc.plan.items import Holdings
from reshard_svc.plan.save import FileSpec, SavePlan, plan_save
from reshard_svc.runtime.buffers import BackgroundWriter, tensor_bytes
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.io_pool import TASK, WritePool
from reshard_svc.runtime.ring import RingSlot, pinned_ring
from reshard_svc.runtime.state_dict import flatten
from reshard_svc.runtime.targets import (
    Placed,
    check_replicas,
    describe,
    gather,
    replica_crcs,
    replicated,
)
from reshard_svc.storage import Storage, open_storage
from reshard_svc.storage.base import Target

__all__ = [
    "PreparedSave",
    "box_bands",
    "prepare_save",
    "save",
    "saved_index",
    "write_and_commit",
    "write_file",
    "write_files",
]

logger = logging.getLogger(__name__)

#: Boxes are copied (and moved off the GPU) in row bands of at most this many bytes.
WRITE_BAND_BYTES = 64 * 1024 * 1024
#: Bytes queued for the hash/write threads before the writing rank waits.
WRITE_QUEUE_BYTES = 256 * 1024 * 1024


def box_bands(view: torch.Tensor, band_bytes: int = WRITE_BAND_BYTES) -> list[torch.Tensor]:
    """A box's data as row bands of at most ``band_bytes`` (one row where a row is
    longer): views, made contiguous (or moved through the pinned ring) one at a time by
    their writer."""
    if view.dim() == 0 or view.numel() == 0:
        return [view]
    row = max(1, view[0].numel() * view.element_size())
    step = max(1, band_bytes // row)
    return [view[i : i + step] for i in range(0, view.shape[0], step)]


def _file_data(
    spec: FileSpec,
    placed: dict[str, Placed],
    crcs: dict[tuple[str, Box], int],
    band_bytes: int = WRITE_BAND_BYTES,
    deferred: bool = False,
) -> Iterator[tuple[int, memoryview, Any]]:
    """Each band of the file's boxes as (file offset, its bytes, what holds them: a tensor,
    or a slot of the pinned ring to release once written), in file order; the CRC32C of
    each box in ``crcs`` (a replicated one) is set from the same bands on the way. Bands
    of contiguous CPU boxes are views; other CPU bands are copied one at a time; device
    bands go through the pinned ring (:class:`~reshard_svc.runtime.ring.PinnedRing`);
    ``deferred``: their copies are only queued, and the consumer waits for each
    (:func:`_ready`) before reading its bytes."""
    at = len(spec.header)
    for name, box in spec.entries:
        view = placed[name].local.get(box)
        if view is None:  # the plan only assigns boxes to their holders
            raise CheckpointError(f"rank holds no data for {name!r} box {box}")
        crc = 0 if (name, box) in crcs else None
        for band in box_bands(view.detach(), band_bytes):
            pieces: Iterable[tuple[memoryview, Any]]
            if _through_ring(band):  # device memory: through the pinned ring, never pageable
                pieces = pinned_ring().pieces(band, deferred=deferred and crc is None)
            else:
                band = band.contiguous()
                pieces = [(tensor_bytes(band), band)]
            for data, keep in pieces:
                if crc is not None:
                    crc = crc32c.crc32c(data, crc)
                yield at, data, keep
                at += data.nbytes
        if crc is not None:
            crcs[(name, box)] = int(crc)


def _through_ring(band: torch.Tensor) -> bool:
    """Whether a band reaches host memory through the pinned ring (it is not on the CPU)."""
    return band.device.type != "cpu"


def _released(keep: Any) -> Callable[[], None] | None:
    """What frees ``keep`` once its bytes are written: a ring slot's release."""
    return keep.release if isinstance(keep, RingSlot) else None


def _ready(keep: Any) -> Callable[[], None] | None:
    """What to wait for before reading ``keep``'s bytes: a ring slot's copy."""
    return keep.wait if isinstance(keep, RingSlot) else None


def write_file(
    staging: Storage,
    spec: FileSpec,
    placed: dict[str, Placed],
    background: BackgroundWriter,
    checksum: str,
    crcs: dict[tuple[str, Box], int],
) -> list[Any]:
    """Write one file front to back; for the boxes in ``crcs`` (replicated ones), set
    their CRC32C, computed from the same bands on their way to the writer."""
    with staging.open_write(spec.name) as raw:
        w = HashingWriter(raw, checksum, DEFAULT_BLOCK_SIZE)
        w.write(spec.header)
        for _, data, band in _file_data(spec, placed, crcs):
            background.submit(w, data, keep=band, done=_released(band))
        background.drain()
    if w.size != spec.size:
        raise CheckpointError(f"{spec.name}: wrote {w.size} bytes, planned {spec.size}")
    return [spec.name, w.size, w.result()]


def write_files_pooled(
    staging: Storage,
    specs: list[FileSpec],
    placed: dict[str, Placed],
    pool: WritePool,
    checksum: str,
    crcs: dict[tuple[str, Box], int],
) -> list[list[Any]]:
    """Write files with the pool's threads, each range at its planned offset, the files at
    once (:mod:`reshard_svc.runtime.io_pool`: their ranges are queued in turn, a task's
    worth at a time, so every lane has work within the queue's bytes); as
    :func:`write_file` otherwise."""
    sizes = [(spec.name, spec.size) for spec in specs]
    with pool.files(staging, sizes, checksum, DEFAULT_BLOCK_SIZE) as outs:
        feeds = []
        for spec, out in zip(specs, outs):
            out.put(0, memoryview(spec.header))
            feeds.append((out, _file_data(spec, placed, crcs, band_bytes=TASK, deferred=True)))
        while feeds:
            for entry in list(feeds):
                out, data = entry
                band = next(data, None)
                if band is None:
                    feeds.remove(entry)
                else:
                    at, piece, keep = band
                    out.put(at, piece, keep=keep, done=_released(keep), ready=_ready(keep))
        return [out.close() for out in outs]


@dataclass(kw_only=True)
class PreparedSave:
    """A save after the ranks agreed on it: what to write where, before any data moves."""

    uri: str
    storage: Storage
    staging: Storage
    placed: dict[str, Placed]  # this rank's tensors
    holdings: dict[str, Holdings]  # every rank's, by tensor
    extras: dict[str, Any]
    plan: SavePlan
    token: str
    checksum: str = "crc32c"
    #: rank 0's hold on the target (lease, commit, abort); None on other ranks
    run: TargetRun | None = None
    #: boxes held by two or more ranks, whose copies must agree (empty when unchecked)
    replicas: dict[str, list[Box]] = field(default_factory=dict)
    #: this rank's CRC32Cs of replicated boxes computed before writing (async saves)
    early_crcs: dict[str, Any] = field(default_factory=dict)
    #: this rank's checking writers (:func:`~reshard_svc.plan.budget.io_threads`)
    io_threads: int = 1


def _describe_mine(state_dict: Mapping[str, Any]) -> tuple[dict[str, Placed], dict[str, Any]]:
    """This rank's tensors (as boxes it holds) and its JSON values."""
    placed: dict[str, Placed] = {}
    extras: dict[str, Any] = {}
    for name, leaf in flatten(state_dict).items():
        if leaf.kind == "extra":
            extras[name] = leaf.value
            continue
        p = placed[name] = describe(leaf)
        try:
            st_code(p.dtype)
        except CheckpointError:
            raise StateDictError(
                f"{name!r} has dtype {p.dtype}, which safetensors cannot store; cast it "
                "(e.g. to float32) before saving"
            ) from None
    return placed, extras


def _agreed_extras(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's JSON values, merged; one key with different values is an error."""
    out: dict[str, Any] = {}
    owner: dict[str, int] = {}
    for rank, extras in enumerate(per_rank):
        for key, value in extras.items():
            if key in out and out[key] != value:
                hint = (
                    " (an optimizer's param_groups differ between pipeline stages: pass "
                    "StateDictOptions(flatten_optimizer_state_dict=True) to get_state_dict, "
                    "as torchtitan does, so each parameter's group is its own key)"
                    if "param_groups" in key
                    else ""
                )
                raise ReplicaMismatchError(
                    f"save: {key!r} differs between ranks: {_short(out[key])} on rank "
                    f"{owner[key]}, {_short(value)} on rank {rank}. Ranks that pass the same key "
                    "hold copies of one value, and copies must agree: per-rank state needs "
                    f"per-rank keys{hint}",
                    tensor=key,
                    ranks=(owner[key], rank),
                )
            out.setdefault(key, value)
            owner.setdefault(key, rank)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def prepare_save(
    state_dict: Mapping[str, Any],
    uri: str,
    comm: Comm,
    storage: Target,
    checksum: str = "crc32c",
    overwrite: bool = False,
    check_replicas: bool = True,
    threads: int | str | None = None,
) -> PreparedSave:
    """Every rank: take the target (rank 0), describe the state dict, learn every tensor's
    holders, and plan the files. ``threads``: the rank's I/O threads (``io_threads``)."""
    count = io_threads(threads)
    run, tokens = comm.run_everywhere(
        f"save({uri!r}): taking the target",
        lambda: TargetRun(storage, "save", overwrite) if comm.rank == 0 else None,
        share=lambda r: r.token if r is not None else "",
    )
    token = tokens[0]
    try:
        got = gather(comm, f"save({uri!r}): describing the state dict", lambda: _sides(state_dict))
        extras = _agreed_extras(got.extras)
    except BaseException:
        if run is not None:
            run.abort(storage.staging(token))
        raise
    holdings = got.holdings["save"]
    staging = storage.staging(token)
    # one file per I/O thread where the storage takes them at once: a count every rank
    # plans with (the most any rank has), whatever each writes its own with
    files = comm.all_reduce_max([count])[0] if staging.positional_writes else 1
    plan = plan_save(
        holdings, comm.world, token=token, file_suffix=staging.file_suffix, files_per_rank=files
    )
    return PreparedSave(
        uri=uri,
        storage=storage,
        staging=staging,
        placed=got.mine["save"],
        holdings=holdings,
        extras=extras,
        plan=plan,
        token=token,
        checksum=checksum,
        run=run,
        replicas=replicated(holdings) if check_replicas else {},
        io_threads=count,
    )


def _sides(state_dict: Mapping[str, Any]) -> tuple[dict[str, dict[str, Placed]], dict[str, Any]]:
    placed, extras = _describe_mine(state_dict)
    return {"save": placed}, extras


def write_files(prep: PreparedSave, rank: int, staging: Storage | None = None) -> dict[str, Any]:
    """This rank's share of the data files (no collectives): ``{"files": [[name, size,
    sums], ...], "replicas": {tensor: [[offsets, crc], ...]}}``. Local files are written
    by ``prep.io_threads`` checking writers at their planned offsets; other storage, and
    sha256 files, front to back."""
    staging = staging or prep.staging
    written = {(n, b) for spec in prep.plan.files_of(rank) for n, b in spec.entries}
    crcs = {(n, b): 0 for n, bs in prep.replicas.items() for b in bs if (n, b) in written}
    on_device = any(_through_ring(v) for p in prep.placed.values() for v in p.local.values())
    with pinned_ring().session() if on_device else contextlib.nullcontext():
        if staging.positional_writes and prep.checksum != "sha256":
            with WritePool(prep.io_threads, WRITE_QUEUE_BYTES) as pool:
                specs = list(prep.plan.files_of(rank))
                files = write_files_pooled(staging, specs, prep.placed, pool, prep.checksum, crcs)
        else:
            with BackgroundWriter(WRITE_QUEUE_BYTES) as background:
                files = [
                    write_file(staging, spec, prep.placed, background, prep.checksum, crcs)
                    for spec in prep.plan.files_of(rank)
                ]
    held_only = {n: [b for b in bs if (n, b) not in written] for n, bs in prep.replicas.items()}
    report = replica_crcs(prep.placed, held_only)
    for (name, box), crc in crcs.items():
        report.setdefault(name, []).append([list(box.offsets), crc])
    for name, entries in prep.early_crcs.items():
        report.setdefault(name, []).extend(entries)
    return {"files": files, "replicas": report}


def saved_index(
    holdings: Mapping[str, Holdings],
    plan: SavePlan,
    written: list[list[Any]],
    extras: Mapping[str, Any],
    checksum: str,
) -> CheckpointIndex:
    """The index of what ``plan`` saved of ``holdings``: ``written`` is every writer's
    ``[name, size, checksums]`` per file (:func:`write_file`)."""
    block_size = DEFAULT_BLOCK_SIZE if checksum != "none" else None
    return CheckpointIndex(
        tensors={
            name: TensorMeta(
                name=name,
                dtype=dtype_from_name(h.dtype),
                shape=h.shape,
                layout=Layout.parse(h.layout) if h.layout else None,
                chunks=plan.chunks[name],
            )
            for name, h in holdings.items()
        },
        files={
            name: FileMeta.from_written(name, size, sums, block_size)
            for name, size, sums in written
        },
        extras=dict(extras),
        created_by=f"reshard_svc {__version__}",
        checksum=checksum,
        block_size=block_size,
    )


def write_and_commit(
    prep: PreparedSave, comm: Comm, written_here: Callable[[], dict[str, Any]] | None = None
) -> CheckpointIndex:
    """Every rank: write the files the plan gives it (or take ``written_here()``, e.g. from
    a forked writer); the replicas are compared; rank 0 commits the index last."""
    staging, plan = prep.staging, prep.plan
    write = written_here or (lambda: write_files(prep, comm.rank))
    try:
        _, written = comm.run_everywhere("save: writing data files", write)
        check_replicas(prep.replicas, [w["replicas"] for w in written], f"save({prep.uri!r})")
    except BaseException:
        if prep.run is not None:
            prep.run.abort(staging)
        raise
    index = saved_index(
        prep.holdings,
        plan,
        [f for per_rank in written for f in per_rank["files"]],
        prep.extras,
        prep.checksum,
    )
    files = index.files

    def commit() -> None:
        if prep.run is None:
            return
        try:
            index.check()
        except BaseException:
            prep.run.abort(staging)
            raise
        prep.run.commit(staging, index.dumps())
        logger.info("committed %s: %d tensors, %d files", prep.uri, len(index.tensors), len(files))

    comm.run_everywhere("save: commit", commit)
    return index


def save(
    state_dict: Mapping[str, Any],
    uri: str,
    *,
    process_group: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    checksum: str = "crc32c",
    overwrite: bool = False,
    check_replicas: bool = True,
    io_threads: int | str | None = None,
) -> CheckpointIndex:
    """Save a (nested) state dict of DTensors, Tensors, ShardedTensors, LocalShards and
    JSON values.

    Called by every rank of ``process_group`` (default: the whole job; without an
    initialised process group, a single process), each with the keys it holds. Returns
    the committed index. ``checksum``: ``"crc32c"`` (block CRCs, checked on every read),
    ``"sha256"`` (the same plus a whole-file sha256) or ``"none"``. A committed
    checkpoint at ``uri`` is only replaced with ``overwrite=True`` (other files in its
    folder are kept).

    Where several ranks hold the same bytes (plain tensors on every rank, ``Replicate``,
    replicated boxes), their CRC32Cs must agree, or every rank raises
    :class:`~reshard_svc.errors.ReplicaMismatchError` and nothing is committed;
    ``check_replicas=False`` skips the comparison (one holder's copy is saved).
    ``io_threads``: this rank's checking writers (default: ``RESHARD_IO_THREADS``, else
    from the CPUs this process may use and the ranks on its node).
    """
    algorithm = check_algorithm(checksum)
    comm = Comm(process_group)
    storage = open_storage(uri, storage_options)
    prep = prepare_save(
        state_dict, uri, comm, storage, algorithm, overwrite, check_replicas, io_threads
    )
    return write_and_commit(prep, comm)
