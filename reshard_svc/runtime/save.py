"""``save``: every rank of a job writes its share of a state dict; rank 0 commits.

Order of events (every rank calls :func:`save` with the same keys):

1. each rank describes its tensors; ranks agree on one plan digest and rank 0's token;
2. each rank streams the boxes it was assigned into safetensors files in the staging
   area, computing block CRC32Cs as it writes;
3. rank 0 writes ``reshard.index.json`` and commits (rename locally, index-last on object
   stores). Any failure on any rank aborts the staging area on every path.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc._version import __version__
from reshard_svc.errors import CheckpointError, StateDictError
from reshard_svc.format.checksums import DEFAULT_BLOCK_SIZE, HashingWriter, check_algorithm
from reshard_svc.format.collect import TargetRun
from reshard_svc.format.index import CheckpointIndex, FileMeta, TensorMeta
from reshard_svc.format.safetensors import st_code
from reshard_svc.plan.save import FileSpec, SavePlan, TensorPlacement, plan_save
from reshard_svc.runtime.buffers import BackgroundWriter, tensor_bytes
from reshard_svc.runtime.comm import Comm
from reshard_svc.runtime.state_dict import flatten
from reshard_svc.runtime.targets import Placed, describe, gather_holders
from reshard_svc.storage import Storage, open_storage

__all__ = [
    "PreparedSave",
    "box_bands",
    "prepare_save",
    "save",
    "write_and_commit",
    "write_files",
]

logger = logging.getLogger(__name__)

#: Boxes are copied (and moved off the GPU) in row bands of at most this many bytes.
WRITE_BAND_BYTES = 64 * 1024 * 1024
#: Bytes queued for the hash/write threads before the writing rank waits.
WRITE_QUEUE_BYTES = 256 * 1024 * 1024


def box_bands(view: torch.Tensor) -> list[torch.Tensor]:
    """A box's data as contiguous CPU row bands of at most WRITE_BAND_BYTES (views when the
    box is already contiguous on the CPU; one band is copied at a time otherwise)."""
    if view.dim() == 0 or view.numel() == 0:
        return [view]
    row = max(1, view[0].numel() * view.element_size())
    step = max(1, WRITE_BAND_BYTES // row)
    return [view[i : i + step] for i in range(0, view.shape[0], step)]


def _write_file(
    staging: Storage,
    spec: FileSpec,
    placed: dict[str, Placed],
    background: BackgroundWriter,
    checksum: str,
) -> list[Any]:
    with staging.open_write(spec.name) as raw:
        w = HashingWriter(raw, checksum, DEFAULT_BLOCK_SIZE)
        w.write(spec.header)
        for name, box in spec.entries:
            view = placed[name].local.get(box)
            if view is None:  # the plan only assigns boxes to their holders
                raise CheckpointError(f"rank holds no data for {name!r} box {box}")
            for band in box_bands(view.detach()):
                band = band.to("cpu").contiguous()
                background.submit(w, tensor_bytes(band), keep=band)
        background.drain()
    if w.size != spec.size:
        raise CheckpointError(f"{spec.name}: wrote {w.size} bytes, planned {spec.size}")
    return [spec.name, w.size, w.result()]


@dataclass
class PreparedSave:
    """A save after the ranks agreed on it: what to write where, before any data moves."""

    uri: str
    storage: Storage
    staging: Storage
    placed: dict[str, Placed]
    extras: dict[str, Any]
    plan: SavePlan
    token: str
    checksum: str = "crc32c"
    #: rank 0's hold on the target (lease, commit, abort); None on other ranks
    run: TargetRun | None = None


def prepare_save(
    state_dict: Mapping[str, Any],
    uri: str,
    comm: Comm,
    storage: Storage,
    checksum: str = "crc32c",
    overwrite: bool = False,
) -> PreparedSave:
    """Every rank: describe the state dict, agree on it and on a token, plan the files."""

    def describe_all() -> dict[str, Any]:
        leaves = flatten(state_dict)
        placed: dict[str, Placed] = {}
        extras: dict[str, Any] = {}
        for name, leaf in leaves.items():
            if leaf.kind == "extra":
                extras[name] = leaf.value
            else:
                placed[name] = describe(leaf, comm)
                try:
                    st_code(placed[name].dtype)
                except CheckpointError:
                    raise StateDictError(
                        f"{name!r} has dtype {placed[name].dtype}, which safetensors cannot "
                        "store; cast it (e.g. to float32) before saving"
                    ) from None
        sig = json.dumps(
            [p.signature() for p in placed.values()] + [sorted(extras)], sort_keys=True
        )
        token = ""
        if comm.rank == 0:
            state["run"] = run = TargetRun(storage, "save", overwrite)
            token = run.token
        state["placed"], state["extras"] = placed, extras
        return {"digest": hashlib.sha256(sig.encode()).hexdigest(), "token": token}

    state: dict[str, Any] = {}
    _, infos = comm.run_everywhere("save: describing the state dict", describe_all)
    run: TargetRun | None = state.get("run")
    if len({i["digest"] for i in infos}) != 1:
        if run is not None:
            run.abort(storage.staging(run.token))
        raise StateDictError(
            "ranks passed different state dicts to save (keys, shapes, dtypes or layouts "
            "differ); every rank must save the same keys"
        )
    token = infos[0]["token"]
    placed: dict[str, Placed] = state["placed"]
    gather_holders(placed, comm)
    staging = storage.staging(token)
    plan = plan_save(
        [
            TensorPlacement(p.name, p.dtype, p.shape, p.layout, tuple(p.boxes))
            for p in placed.values()
        ],
        comm.world,
        token=token,
        file_suffix=staging.file_suffix,
    )
    return PreparedSave(
        uri, storage, staging, placed, dict(state["extras"]), plan, token, checksum, run
    )


def write_files(prep: PreparedSave, rank: int, staging: Storage | None = None) -> list[Any]:
    """This rank's share of the data files (no collectives): [[name, size, sums], ...]."""
    staging = staging or prep.staging
    with BackgroundWriter(WRITE_QUEUE_BYTES) as background:
        return [
            _write_file(staging, spec, prep.placed, background, prep.checksum)
            for spec in prep.plan.files_of(rank)
        ]


def write_and_commit(
    prep: PreparedSave, comm: Comm, written_here: Callable[[], list[Any]] | None = None
) -> CheckpointIndex:
    """Every rank: write the files the plan gives it (or take ``written_here()``, e.g. from
    a forked writer); rank 0 commits the index last."""
    staging, placed, plan = prep.staging, prep.placed, prep.plan
    write = written_here or (lambda: write_files(prep, comm.rank))
    try:
        _, written = comm.run_everywhere("save: writing data files", write)
    except BaseException:
        if prep.run is not None:
            prep.run.abort(staging)
        raise
    block_size = DEFAULT_BLOCK_SIZE if prep.checksum != "none" else None
    files = {
        name: FileMeta.from_written(name, size, sums, block_size)
        for per_rank in written
        for name, size, sums in per_rank
    }
    index = CheckpointIndex(
        tensors={
            p.name: TensorMeta(p.name, p.dtype, p.shape, p.layout, plan.chunks[p.name])
            for p in placed.values()
        },
        files=files,
        extras=prep.extras,
        created_by=f"reshard_svc {__version__}",
        checksum=prep.checksum,
        block_size=block_size,
    )

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
) -> CheckpointIndex:
    """Save a (nested) state dict of DTensors, Tensors, ShardedTensors and JSON values.

    Called by every rank of ``process_group`` (default: the whole job; without an
    initialised process group, a single process). Returns the committed index.
    ``checksum``: ``"crc32c"`` (block CRCs, checked on every read), ``"sha256"`` (the
    same plus a whole-file sha256) or ``"none"``. A committed checkpoint at ``uri`` is
    only replaced with ``overwrite=True`` (other files in its folder are kept).
    """
    algorithm = check_algorithm(checksum)
    comm = Comm(process_group)
    storage = open_storage(uri, storage_options)
    prep = prepare_save(state_dict, uri, comm, storage, algorithm, overwrite)
    return write_and_commit(prep, comm)
