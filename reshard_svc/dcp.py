"""reshard_svc as a ``torch.distributed.checkpoint`` storage backend.

Code that saves with ``dcp.save`` / ``dcp.async_save`` and loads with ``dcp.load`` switches
by passing our writer or reader; DCP's own planner plans on this path::

    dcp.save(state_dict, storage_writer=reshard_svc.dcp.Writer("s3://bucket/run/step-100"))
    dcp.load(state_dict, storage_reader=reshard_svc.dcp.Reader("s3://bucket/run/step-100"))

:class:`Writer` writes our format: each tensor write item's bytes as a chunk of the named
tensor (safetensors, block CRC32Cs), DCP's byte items (its pickled non-tensor values)
carried verbatim as opaque blobs, and the index last, under the target's lease (taken by
the coordinator before any rank writes), after DCP's ``finish``. ``reshard_svc.load``,
``convert``, ``inspect`` and ``verify`` read the result like any checkpoint of ours.

:class:`Reader` gives DCP every source we read (ours, torch DCP, Hugging Face,
torch_checkpointing, Megatron-Core), every byte checked against its block CRC32C where the
source records them. Our JSON values are offered to DCP as byte items (``torch.save`` of
the value), as DCP stores its own.

Which ranks call what (DCP's order): every rank ``set_up_storage_writer`` and
``prepare_local_plan``; the coordinator ``prepare_global_plan`` (here it takes the lease
and names each rank's files); every rank ``write_data``; the coordinator ``finish`` (the
commit). A writer killed before ``finish`` commits nothing; ``reshard gc`` (or the next
save to the target) collects what it wrote.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from reshard_svc.errors import CheckpointError, UsageError
from reshard_svc.format.checksums import DEFAULT_BLOCK_SIZE, HashingWriter, check_algorithm
from reshard_svc.format.collect import TargetRun
from reshard_svc.format.index import (
    INDEX_NAME,
    Blob,
    CheckpointIndex,
    Chunk,
    FileMeta,
    TensorMeta,
)
from reshard_svc.format.readers import open_checkpoint
from reshard_svc.format.safetensors import dtype_name
from reshard_svc.layout import Box
from reshard_svc.plan.items import Read
from reshard_svc.plan.save import rank_files
from reshard_svc.runtime.buffers import BackgroundWriter
from reshard_svc.runtime.reading import CheckedReader, band_view, read_bands
from reshard_svc.runtime.save import WRITE_QUEUE_BYTES, write_file
from reshard_svc.runtime.targets import Placed
from reshard_svc.storage import open_storage

__all__ = ["INDEX_FILE", "Reader", "Writer"]

#: The file whose presence marks one of our checkpoints committed (written last). A
#: framework that finds complete checkpoints by a metadata file (DCP's ``.metadata``)
#: looks for this one instead.
INDEX_FILE = INDEX_NAME


def _uri(checkpoint_id: str | os.PathLike[str] | None, where: str) -> str:
    if checkpoint_id is None:
        raise UsageError(f"{where} needs a checkpoint URI (a folder, s3://, memory://, ...)")
    return os.fspath(checkpoint_id)


class Writer(StorageWriter):
    """A ``StorageWriter`` for ``dcp.save`` / ``dcp.async_save`` that writes our format at
    ``uri`` (any fsspec URI). ``overwrite`` replaces a committed checkpoint there;
    ``checksum`` is ``crc32c`` (block CRC32Cs, checked on every read), ``sha256`` or
    ``none``."""

    def __init__(
        self,
        uri: str | os.PathLike[str] | None = None,
        *,
        overwrite: bool = False,
        checksum: str = "crc32c",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.uri = os.fspath(uri) if uri is not None else None
        self.overwrite = overwrite
        self.checksum = check_algorithm(checksum)
        self.storage_options = storage_options
        self.is_coordinator = False
        self.rank = 0
        self._run: TargetRun | None = None

    @property
    def checkpoint_id(self) -> str | None:
        return self.uri

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)
        self._run = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if kwargs.get("rank") is None:
            import torch.distributed as dist

            self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator takes the target's lease (before any rank writes) and names each
        rank's files; each plan carries them in ``storage_data``."""
        uri = _uri(self.uri, "reshard_svc.dcp.Writer")
        storage = open_storage(uri, self.storage_options)
        self._run = TargetRun(storage, "save", self.overwrite)
        suffix = storage.staging(self._run.token).file_suffix
        out = []
        for rank, plan in enumerate(plans):
            entries, dtypes, blobs = [], {}, []
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    blobs.append(item.index.fqn)
                    continue
                td = item.tensor_data
                if td is None:  # pragma: no cover (DCP gives every tensor item its data)
                    raise CheckpointError(f"write item {item.index.fqn!r} has no tensor data")
                entries.append(
                    (item.index.fqn, Box(tuple(td.chunk.offsets), tuple(td.chunk.sizes)))
                )
                dtypes[item.index.fqn] = td.properties.dtype
            files = [
                [spec.name, [[n, list(b.offsets), list(b.sizes)] for n, b in spec.entries]]
                for spec, _ in rank_files(rank, entries, dtypes, marked=True, file_suffix=suffix)
            ]
            data = {
                "token": self._run.token,
                "files": files,
                "dtypes": {n: dtype_name(d) for n, d in dtypes.items()},
                "blobs": f"blobs-{rank:05d}{suffix}.bin" if blobs else None,
            }
            out.append(dataclasses.replace(plan, storage_data=data))
        return out

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        """This rank's files, streamed with block CRC32Cs; the results say where each item
        landed and what each file holds."""
        data = plan.storage_data
        if not isinstance(data, dict) or "token" not in data:
            raise CheckpointError("reshard_svc.dcp.Writer: the plan has no file assignment")
        storage = open_storage(_uri(self.uri, "reshard_svc.dcp.Writer"), self.storage_options)
        staging = storage.staging(data["token"])
        items = {(i.index.fqn, _offsets(i)): i for i in plan.items}
        from reshard_svc.format.safetensors import dtype_from_name

        dtypes = {n: dtype_from_name(d) for n, d in data["dtypes"].items()}
        results: list[WriteResult] = []
        entries = []
        for _, group in data["files"]:
            entries += [(n, Box(tuple(o), tuple(s))) for n, o, s in group]
        specs = rank_files(self.rank, entries, dtypes, marked=True, file_suffix=staging.file_suffix)
        with BackgroundWriter(WRITE_QUEUE_BYTES) as background:
            for spec, placed_chunks in specs:
                placed: dict[str, Placed] = {}
                for name, box in spec.entries:
                    item = items[(name, box.offsets)]
                    tensor = planner.resolve_data(item)
                    if not isinstance(tensor, torch.Tensor):
                        raise CheckpointError(f"write item {name!r} resolved to no tensor")
                    p = placed.setdefault(
                        name, Placed(name=name, dtype=tensor.dtype, shape=(), layout=None)
                    )
                    p.local[box] = tensor.detach()
                fname, size, sums = write_file(staging, spec, placed, background, self.checksum, {})
                for i, (name, chunk) in enumerate(placed_chunks):
                    item = items[(name, chunk.box.offsets)]
                    results.append(
                        WriteResult(
                            index=item.index,
                            size_in_bytes=chunk.end - chunk.begin,
                            storage_data={
                                "file": fname,
                                "begin": chunk.begin,
                                "end": chunk.end,
                                **({"file_meta": [size, sums]} if i == 0 else {}),
                            },
                        )
                    )
        if data["blobs"]:
            results += self._write_blobs(staging, data["blobs"], plan.items, planner)
        future: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        future.set_result(results)
        return future

    def _write_blobs(
        self, staging: Any, fname: str, items: Sequence[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        out = []
        with staging.open_write(fname) as raw:
            w = HashingWriter(raw, self.checksum, DEFAULT_BLOCK_SIZE)
            for item in items:
                if item.type != WriteItemType.BYTE_IO:
                    continue
                value = planner.resolve_data(item)
                data = value.getbuffer() if isinstance(value, io.BytesIO) else bytes(value)
                begin = w.size
                w.write(data)
                out.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=len(data),
                        storage_data={"file": fname, "begin": begin, "end": w.size, "blob": True},
                    )
                )
            sums = w.result()
        if out:
            out[0].storage_data["file_meta"] = [w.size, sums]
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator: our index from DCP's metadata and every rank's results, written
        last (the commit), under the lease taken in ``prepare_global_plan``."""
        if self._run is None:
            raise CheckpointError("reshard_svc.dcp.Writer.finish before prepare_global_plan")
        run, self._run = self._run, None
        staging = run.storage.staging(run.token)
        try:
            index = self._index(metadata, [r for rank in results for r in rank])
            index.check()
            run.commit(staging, index.dumps())
        except BaseException:
            run.abort(staging)
            raise

    def _index(self, metadata: Metadata, results: list[WriteResult]) -> CheckpointIndex:
        block_size = DEFAULT_BLOCK_SIZE if self.checksum != "none" else None
        files: dict[str, FileMeta] = {}
        chunks: dict[str, list[Chunk]] = {}
        blobs: dict[str, Blob] = {}
        for r in results:
            d = r.storage_data
            if "file_meta" in d:
                size, sums = d["file_meta"]
                files[d["file"]] = FileMeta.from_written(d["file"], size, sums, block_size)
            if d.get("blob"):
                blobs[r.index.fqn] = Blob(
                    name=r.index.fqn, file=d["file"], begin=d["begin"], end=d["end"]
                )
                continue
            md = metadata.state_dict_metadata.get(r.index.fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"DCP's metadata has no tensor {r.index.fqn!r}")
            sizes = _chunk_sizes(md, r.index.offset)
            chunks.setdefault(r.index.fqn, []).append(
                Chunk(
                    box=Box(tuple(r.index.offset or ()), sizes),
                    file=d["file"],
                    begin=d["begin"],
                    end=d["end"],
                )
            )
        from reshard_svc._version import __version__

        tensors = {
            fqn: TensorMeta(
                name=fqn,
                dtype=md.properties.dtype,
                shape=tuple(md.size),
                layout=None,
                chunks=tuple(sorted(chunks.get(fqn, []), key=lambda c: c.box)),
            )
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        return CheckpointIndex(
            tensors=tensors,
            files=files,
            blobs=blobs,
            created_by=f"reshard_svc {__version__} (torch.distributed.checkpoint)",
            checksum=self.checksum,
            block_size=block_size,
        )


def _offsets(item: WriteItem) -> tuple[int, ...]:
    td = item.tensor_data
    return tuple(td.chunk.offsets) if td is not None else ()


def _chunk_sizes(md: TensorStorageMetadata, offsets: Sequence[int] | None) -> tuple[int, ...]:
    want = tuple(offsets or ())
    for c in md.chunks:
        if tuple(c.offsets) == want:
            return tuple(c.sizes)
    raise CheckpointError(f"no chunk at {list(want)} in DCP's metadata")


class Reader(StorageReader):
    """A ``StorageReader`` for ``dcp.load`` over every checkpoint we read at ``uri``: ours,
    torch DCP, Hugging Face, torch_checkpointing, Megatron-Core. Every byte read from a
    file with block CRC32Cs is checked before DCP sees it. ``bytes_read`` counts what this
    rank fetched from storage (whole checked blocks included)."""

    def __init__(
        self,
        uri: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.uri = os.fspath(uri) if uri is not None else None
        self.storage_options = storage_options
        self._storage: Any = None
        self._index: CheckpointIndex | None = None
        self.bytes_read = 0

    @property
    def checkpoint_id(self) -> str | None:
        return self.uri

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)
        self._storage = self._index = None
        self.bytes_read = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)

    def _open(self) -> CheckpointIndex:
        if self._index is None:
            self._storage, self._index = open_checkpoint(
                _uri(self.uri, "reshard_svc.dcp.Reader"), self.storage_options
            )
        return self._index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = self._open()
        md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for name, t in index.tensors.items():
            md[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=t.dtype),
                size=torch.Size(t.shape),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(c.box.offsets), sizes=torch.Size(c.box.sizes)
                    )
                    for c in t.chunks
                ],
            )
        for name in (*index.blobs, *index.extras):
            md.setdefault(name, BytesStorageMetadata())
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Each chunk a read item needs is read once (checked), then narrowed into DCP's
        target; byte items get their blob (or a JSON value as ``torch.save`` bytes)."""
        index = self._open()
        storage = self._storage
        tables = index.block_tables()
        checked = CheckedReader(storage, tables, storage.local_files)
        by_chunk: dict[tuple[str, tuple[int, ...]], list[ReadItem]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self._bytes(item.storage_index.fqn, checked)))
                continue
            key = (item.storage_index.fqn, tuple(item.storage_index.offset or ()))
            by_chunk.setdefault(key, []).append(item)
        for (name, offsets), items in by_chunk.items():
            meta = index.tensors[name]
            chunk = next((c for c in meta.chunks if c.box.offsets == offsets), None)
            if chunk is None:
                raise CheckpointError(f"{self.uri}: no chunk of {name!r} at {list(offsets)}")
            read = Read(
                id=0,
                tensor=name,
                box=chunk.box,
                reader=0,
                file=chunk.file,
                begin=chunk.begin,
                end=chunk.end,
                encoding=chunk.encoding,
            )
            if chunk.file in tables:
                raw = checked.read([read])[0]
            else:
                raw = read_bands(storage, [(chunk.file, chunk.begin, chunk.end)])[0]
                self.bytes_read += chunk.end - chunk.begin
            whole = band_view(read, raw, meta.dtype)
            for item in items:
                src = whole
                for d, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                    src = src.narrow(d, o, n)
                target = planner.resolve_tensor(item).detach()
                target.copy_(src)
                planner.commit_tensor(item, target)
        self.bytes_read += checked.bytes_fetched
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    def _bytes(self, name: str, checked: CheckedReader) -> bytes:
        index = self._open()
        blob = index.blobs.get(name)
        if blob is not None:
            read = Read(
                id=0,
                tensor=name,
                box=Box((), ()),
                reader=0,
                file=blob.file,
                begin=blob.begin,
                end=blob.end,
            )
            if blob.file in checked.tables:
                return bytes(checked.read([read])[0].numpy())
            self.bytes_read += blob.end - blob.begin
            return bytes(read_bands(self._storage, [(blob.file, blob.begin, blob.end)])[0].numpy())
        if name in index.extras:
            buf = io.BytesIO()
            torch.save(index.extras[name], buf)
            return buf.getvalue()
        raise CheckpointError(f"{self.uri} holds no value {name!r}")
