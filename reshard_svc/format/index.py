"""``reshard.index.json``: the versioned, human-readable manifest of a checkpoint (format v2).

::

    {
      "format": "reshard", "format_version": 2, "created_by": "reshard_svc 0.1.0",
      "checksum": {"algorithm": "crc32c", "block_size": 4194304},
      "tensors": {
        "model.layers.0.attn.wq.weight": {
          "dtype": "bfloat16", "shape": [4096, 4096],
          "layout": {"mesh": {"shape": [4], "names": ["tp"]}, "placements": ["S(0)"]},
          "chunks": [{"offsets": [0, 0], "sizes": [1024, 4096],
                      "file": "shard-00000-000.safetensors", "byte_range": [96, 8388704]}]
        }
      },
      "files": {"shard-00000-000.safetensors":
                  {"size": 8388704, "crc32c": "9a3f01c2", "blocks": "<8 hex digits per block>"}},
      "extras": {"step": 100}
    }

v2 adds the block CRC32C table of every data file (see :mod:`reshard_svc.format.checksums`);
``"algorithm": "sha256"`` adds a whole-file sha256 as well, ``"none"`` records no
checksums. v1 checkpoints (an optional whole-file sha256 only) stay readable.

The index is written last; its presence is the commit. Parsing validates structure and
raises typed errors; :meth:`CheckpointIndex.check` validates geometry (chunks tile each
tensor, byte ranges match chunk sizes and lie inside their files).
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard_svc._collector import collector_paused
from reshard_svc.errors import (
    CorruptCheckpointError,
    InconsistentIndexError,
    LayoutError,
    UnsupportedFormatError,
)
from reshard_svc.format.checksums import ALGORITHMS, BlockTable, check_block_size
from reshard_svc.format.safetensors import dtype_from_name, dtype_name, itemsize
from reshard_svc.layout import Box, Layout
from reshard_svc.layout.box import check_tiling

__all__ = [
    "Blob",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "Chunk",
    "CheckpointIndex",
    "FileMeta",
    "TensorMeta",
]

INDEX_NAME = "reshard.index.json"
FORMAT_NAME = "reshard"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One stored box of a tensor: raw row-major bytes ``[begin, end)`` of ``file``."""

    box: Box
    file: str
    begin: int
    end: int
    #: ``raw`` (row-major bytes, native and safetensors) or ``torch_save`` (DCP .distcp item)
    encoding: str = "raw"

    def to_json(self) -> dict[str, Any]:
        out = {**self.box.to_json(), "file": self.file, "byte_range": [self.begin, self.end]}
        if self.encoding != "raw":
            out["encoding"] = self.encoding
        return out


_ENCODING = operator.attrgetter("encoding")
_RAW_SIG = operator.attrgetter("box.offsets", "box.sizes", "encoding")
_PLACE = operator.attrgetter("file", "begin")


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout | None
    chunks: tuple[Chunk, ...]
    #: What a read plan depends on, built once with the index (a plan is one pass over
    #: these, not over the Chunk objects): per chunk (offsets, sizes, encoding) — plus the
    #: stored length for encoded chunks, which are read whole — and (file, begin).
    plan_chunks: tuple[Any, ...] = field(init=False, repr=False, compare=False)
    plan_places: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cs = self.chunks
        sig: tuple[Any, ...]
        if set(map(_ENCODING, cs)) == {"raw"}:
            sig = tuple(map(_RAW_SIG, cs))
        else:
            sig = tuple((*_RAW_SIG(c), c.end - c.begin) for c in cs)
        object.__setattr__(self, "plan_chunks", sig)
        object.__setattr__(self, "plan_places", tuple(map(_PLACE, cs)))

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "layout": self.layout.to_json() if self.layout else None,
            "chunks": [c.to_json() for c in self.chunks],
        }


@dataclass(frozen=True)
class FileMeta:
    """A data file's size and checksums (``blocks`` is None for v1 or ``checksum="none"``)."""

    size: int
    sha256: str | None = None
    blocks: BlockTable | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size}
        if self.blocks is not None:
            out["crc32c"] = f"{self.blocks.composite:08x}"
            out["blocks"] = self.blocks.to_hex()
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out

    @classmethod
    def from_written(
        cls, name: str, size: int, sums: dict[str, Any], block_size: int | None
    ) -> FileMeta:
        """From what a writer computed (:meth:`FileChecksummer.result`)."""
        blocks = None
        if "blocks" in sums and block_size:
            blocks = BlockTable.parse(name, size, block_size, sums["blocks"], name)
        return cls(size, sums.get("sha256"), blocks)


@dataclass(frozen=True, kw_only=True)
class Blob:
    """An opaque stored object, e.g. a DCP ``BytesStorageMetadata`` item (torchtitan's
    train_state, a dataloader's state): bytes ``[begin, end)`` of ``file``, carried through
    ``convert`` verbatim and never deserialized. ``encoding`` says what the bytes are
    (``torch_save``: a ``torch.save`` stream, i.e. a pickle; ``raw``: anything)."""

    name: str
    file: str
    begin: int
    end: int
    encoding: str = "torch_save"
    #: the state-dict key its value sits at when that is not its name (``""``: the root,
    #: as Megatron's ``common.pt``; ``step`` for torch_checkpointing's ``step/rank0``)
    key: str | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def value_key(self) -> str:
        return self.name if self.key is None else self.key

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "file": self.file,
            "byte_range": [self.begin, self.end],
            "encoding": self.encoding,
        }
        if self.key is not None:
            out["key"] = self.key
        return out


BLOB_ENCODINGS = ("torch_save", "raw")


@dataclass(kw_only=True)
class CheckpointIndex:
    """A whole checkpoint's metadata. ``source`` says what it was read from."""

    tensors: dict[str, TensorMeta]
    files: dict[str, FileMeta]
    extras: dict[str, Any] = field(default_factory=dict)
    source: str = FORMAT_NAME
    created_by: str = ""
    #: ``crc32c``, ``sha256`` or ``none``; block tables use ``block_size``.
    checksum: str = "none"
    block_size: int | None = None
    #: opaque objects (never deserialized), by name
    blobs: dict[str, Blob] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def block_tables(self) -> dict[str, BlockTable]:
        """File name -> block CRC table, for every file that has one."""
        return {n: f.blocks for n, f in self.files.items() if f.blocks is not None}

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "created_by": self.created_by,
            "checksum": {"algorithm": self.checksum, "block_size": self.block_size},
            "tensors": {k: self.tensors[k].to_json() for k in sorted(self.tensors)},
            "files": {k: self.files[k].to_json() for k in sorted(self.files)},
            "extras": self.extras,
        }
        if self.blobs:
            out["blobs"] = {k: self.blobs[k].to_json() for k in sorted(self.blobs)}
        return out

    def dumps(self) -> bytes:
        """The index as JSON, one tensor, file or opaque item per line: easy to grep and
        diff, and written by json's C encoder (``indent=`` would switch to its pure-Python
        one, about 20 times slower on a 1,000-tensor index)."""
        data = self.to_json()
        lines = ["{"]
        for i, (key, value) in enumerate(data.items()):
            end = "," if i < len(data) - 1 else ""
            if isinstance(value, dict) and key in ("tensors", "files", "blobs") and value:
                lines.append(f" {json.dumps(key)}: {{")
                last = len(value) - 1
                lines.extend(
                    f"  {json.dumps(k)}: {json.dumps(v)}{',' if j < last else ''}"
                    for j, (k, v) in enumerate(value.items())
                )
                lines.append(" }" + end)
            else:
                lines.append(f" {json.dumps(key)}: {json.dumps(value)}{end}")
        lines.append("}")
        return ("\n".join(lines) + "\n").encode()

    @classmethod
    def loads(cls, raw: bytes, where: str = INDEX_NAME) -> CheckpointIndex:
        with collector_paused():  # thousands of small objects: no full collection
            try:
                data = json.loads(raw)
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise CorruptCheckpointError(f"{where} is not valid JSON: {e}") from e
            return cls.from_json(data, where)

    @classmethod
    def from_json(cls, data: Any, where: str = INDEX_NAME) -> CheckpointIndex:
        if not isinstance(data, dict):
            raise CorruptCheckpointError(f"{where}: top level must be a JSON object")
        if data.get("format") != FORMAT_NAME:
            raise UnsupportedFormatError(
                f"{where}: format is {data.get('format')!r}, expected {FORMAT_NAME!r}"
            )
        version = data.get("format_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise UnsupportedFormatError(
                f"{where}: format_version {version!r} is not supported by this release "
                f"(reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade reshard-svc"
            )
        algorithm, block_size = _checksum_settings(data, version, where)
        files_raw = _obj(data, "files", where)
        files: dict[str, FileMeta] = {}
        for name, f in files_raw.items():
            fw = f"{where}: files[{name!r}]"
            _check_file_name(name, fw)
            if not isinstance(f, dict):
                raise CorruptCheckpointError(f"{fw} must be an object")
            files[name] = _file_from_json(name, f, fw, algorithm, block_size)
        tensors: dict[str, TensorMeta] = {}
        for name, t in _obj(data, "tensors", where).items():
            tensors[name] = _tensor_from_json(name, t, where)
        extras = data.get("extras", {})
        if not isinstance(extras, dict):
            raise CorruptCheckpointError(f"{where}: extras must be a JSON object")
        blobs = {}
        for name, b in (_obj(data, "blobs", where) if "blobs" in data else {}).items():
            blobs[name] = _blob_from_json(name, b, f"{where}: blobs[{name!r}]")
        return cls(
            tensors=tensors,
            files=files,
            extras=extras,
            source=FORMAT_NAME,
            created_by=str(data.get("created_by", "")),
            checksum=algorithm,
            block_size=block_size,
            blobs=blobs,
        )

    def check(self) -> None:
        """Geometry checks: tiling, byte ranges, file references. Raises on the first problem."""
        tiled: set[Any] = set()  # (shape, chunk geometry) already checked
        for t in self.tensors.values():
            where = f"tensor {t.name!r}"
            for c in t.chunks:
                if c.box.ndim != len(t.shape):
                    raise InconsistentIndexError(
                        f"{where}: chunk {c.box.offsets} has {c.box.ndim} dims, shape has "
                        f"{len(t.shape)}"
                    )
                want = c.box.numel * t.itemsize
                if c.encoding == "raw" and c.end - c.begin != want:
                    raise InconsistentIndexError(
                        f"{where}: chunk {c.box.offsets}+{c.box.sizes} spans "
                        f"{c.end - c.begin} bytes of {c.file} but needs {want}"
                    )
                meta = self.files.get(c.file)
                if meta is None:
                    raise InconsistentIndexError(
                        f"{where}: chunk refers to {c.file!r}, which the index does not list"
                    )
                if c.begin < 0 or c.end > meta.size:
                    raise InconsistentIndexError(
                        f"{where}: byte range [{c.begin}, {c.end}) lies outside {c.file} "
                        f"({meta.size} bytes)"
                    )
            key = (t.shape, t.plan_chunks)  # the layers of a model share their geometry
            if key not in tiled:
                check_tiling(t.shape, [c.box for c in t.chunks], what=where)
                tiled.add(key)
        spans: dict[str, list[tuple[int, int, str]]] = {}
        for t in self.tensors.values():
            for c in t.chunks:
                # "@": a slice of a stored item (--split-layers), which its siblings share
                if c.end > c.begin and "@" not in c.encoding:
                    spans.setdefault(c.file, []).append((c.begin, c.end, t.name))
        for b in self.blobs.values():
            meta = self.files.get(b.file)
            if meta is None or not 0 <= b.begin <= b.end <= meta.size:
                raise InconsistentIndexError(
                    f"blob {b.name!r}: byte range [{b.begin}, {b.end}) of {b.file!r} is not "
                    "inside a listed file"
                )
            if b.end > b.begin:
                spans.setdefault(b.file, []).append((b.begin, b.end, b.name))
        for fname, ss in spans.items():
            ss.sort()
            for (_, e0, n0), (b1, _, n1) in zip(ss, ss[1:]):
                if b1 < e0:
                    raise InconsistentIndexError(
                        f"{fname}: byte ranges of {n0!r} and {n1!r} overlap"
                    )


def _blob_from_json(name: str, b: Any, where: str) -> Blob:
    if not isinstance(b, dict):
        raise CorruptCheckpointError(f"{where} must be an object")
    file = b.get("file")
    if not isinstance(file, str):
        raise CorruptCheckpointError(f"{where}: file must be text")
    _check_file_name(file, where)
    rng = _ints(b.get("byte_range"), f"{where}: byte_range")
    if len(rng) != 2 or not 0 <= rng[0] <= rng[1]:
        raise CorruptCheckpointError(f"{where}: byte_range must be [begin, end]")
    encoding = b.get("encoding", "raw")
    if encoding not in BLOB_ENCODINGS:
        raise CorruptCheckpointError(
            f"{where}: encoding {encoding!r} is not one of {BLOB_ENCODINGS}"
        )
    key = b.get("key")
    if key is not None and (not isinstance(key, str) or len(key) > 4096):
        raise CorruptCheckpointError(f"{where}: key must be text")
    return Blob(name=name, file=file, begin=rng[0], end=rng[1], encoding=encoding, key=key)


def _checksum_settings(data: Mapping[str, Any], version: int, where: str) -> tuple[str, int | None]:
    """(algorithm, block_size) of an index; v1 had whole-file sha256 at most."""
    if version == 1:
        return (
            "sha256"
            if any(
                isinstance(f, dict) and f.get("sha256") for f in (data.get("files") or {}).values()
            )
            else "none"
        ), None
    cs = data.get("checksum")
    if not isinstance(cs, dict):
        raise CorruptCheckpointError(f"{where}: 'checksum' must be an object")
    algorithm = cs.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise CorruptCheckpointError(
            f"{where}: checksum.algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}"
        )
    if algorithm == "none" or (algorithm == "sha256" and cs.get("block_size") is None):
        return algorithm, None  # no block table (sha256 only: a v1 checkpoint re-described)
    return algorithm, check_block_size(cs.get("block_size"), f"{where}: checksum")


def _file_from_json(
    name: str, f: dict[str, Any], fw: str, algorithm: str, block_size: int | None
) -> FileMeta:
    size = _int(f.get("size"), f"{fw}.size")
    sha = f.get("sha256")
    if sha is not None and not (
        isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)
    ):
        raise CorruptCheckpointError(f"{fw}.sha256 must be 64 lowercase hex characters")
    if algorithm == "sha256" and block_size is not None and sha is None:
        raise CorruptCheckpointError(f"{fw} has no sha256, which the index's algorithm requires")
    if block_size is None:
        return FileMeta(size, sha)
    blocks = BlockTable.parse(name, size, block_size, f.get("blocks"), fw)
    whole = f.get("crc32c")
    if whole != f"{blocks.composite:08x}":
        raise CorruptCheckpointError(
            f"{fw}.crc32c is {whole!r}, but its block table gives {blocks.composite:08x}: "
            "the block table was altered"
        )
    return FileMeta(size, sha, blocks)


def _obj(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: {key!r} must be a JSON object")
    return value


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CorruptCheckpointError(f"{where} must be a non-negative integer, got {value!r}")
    return value


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{where} must be a list of integers, got {value!r}")
    return tuple(_int(v, where) for v in value)


def _nonneg_ints(value: Any) -> tuple[int, ...] | None:
    if type(value) is not list:
        return None
    for v in value:
        if type(v) is not int or v < 0:
            return None
    return tuple(value)


def _chunk_fast(c: Any, files_ok: set[str]) -> Chunk | None:
    """A raw chunk whose fields are all well-formed (``files_ok``: names already checked),
    else None: the caller then checks it field by field and says what is wrong."""
    if type(c) is not dict or c.get("encoding", "raw") != "raw":
        return None
    offs, sizes = _nonneg_ints(c.get("offsets")), _nonneg_ints(c.get("sizes"))
    br, fname = _nonneg_ints(c.get("byte_range")), c.get("file")
    if offs is None or sizes is None or br is None or len(offs) != len(sizes):
        return None
    if len(br) != 2 or br[0] > br[1] or type(fname) is not str:
        return None
    if fname not in files_ok:
        try:
            _check_file_name(fname, "")
        except CorruptCheckpointError:
            return None
        files_ok.add(fname)
    return Chunk(box=Box.trusted(offs, sizes), file=fname, begin=br[0], end=br[1], encoding="raw")


def _check_file_name(name: str, where: str) -> None:
    # File names are relative names inside the checkpoint folder, never paths.
    if not name or "/" in name or "\\" in name or name in (".", "..") or "::" in name:
        raise CorruptCheckpointError(f"{where}: {name!r} is not a plain file name")


def _tensor_from_json(name: str, t: Any, where: str) -> TensorMeta:
    tw = f"{where}: tensors[{name!r}]"
    if not isinstance(t, dict):
        raise CorruptCheckpointError(f"{tw} must be an object")
    dtype = dtype_from_name(t.get("dtype"))  # type: ignore[arg-type]
    shape = _ints(t.get("shape"), f"{tw}.shape")
    layout = None
    if t.get("layout") is not None:
        try:
            layout = Layout.from_json(t["layout"])
        except LayoutError as e:
            raise CorruptCheckpointError(f"{tw}.layout: {e}") from e
    chunks_raw = t.get("chunks")
    if not isinstance(chunks_raw, list):
        raise CorruptCheckpointError(f"{tw}.chunks must be a list")
    chunks = []
    files_ok: set[str] = set()
    for i, c in enumerate(chunks_raw):
        fast = _chunk_fast(c, files_ok)  # the common, valid chunk without building messages
        if fast is not None:
            chunks.append(fast)
            continue
        cw = f"{tw}.chunks[{i}]"
        if not isinstance(c, dict):
            raise CorruptCheckpointError(f"{cw} must be an object")
        offs = _ints(c.get("offsets"), f"{cw}.offsets")
        sizes = _ints(c.get("sizes"), f"{cw}.sizes")
        if len(offs) != len(sizes):
            raise CorruptCheckpointError(f"{cw}: offsets and sizes differ in length")
        fname = c.get("file")
        if not isinstance(fname, str):
            raise CorruptCheckpointError(f"{cw}.file must be a file name")
        _check_file_name(fname, cw)
        br = _ints(c.get("byte_range"), f"{cw}.byte_range")
        if len(br) != 2 or br[0] > br[1]:
            raise CorruptCheckpointError(f"{cw}.byte_range must be [begin, end]")
        encoding = c.get("encoding", "raw")
        if encoding not in ("raw", "torch_save"):
            raise CorruptCheckpointError(f"{cw}.encoding {encoding!r} is unknown")
        chunks.append(
            Chunk(box=Box(offs, sizes), file=fname, begin=br[0], end=br[1], encoding=encoding)
        )
    return TensorMeta(name=name, dtype=dtype, shape=shape, layout=layout, chunks=tuple(chunks))
