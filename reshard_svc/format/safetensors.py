"""The safetensors container: dtype names, header encoding, and strict header parsing.

A safetensors file is ``u64 little-endian header length`` + ``JSON header`` + data. The
header maps each key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data start) and may carry ``__metadata__`` (str -> str). We write headers
ourselves so a file's layout is known before any data moves, and we parse them ourselves
so hostile files get a typed error instead of a crash.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc.errors import CorruptCheckpointError

__all__ = [
    "HEADER_LIMIT",
    "HeaderEntry",
    "ParsedHeader",
    "encode_header",
    "parse_header",
    "st_code",
    "dtype_from_name",
    "dtype_name",
    "itemsize",
]

# Largest header we accept; safetensors itself caps headers at 100 MB.
HEADER_LIMIT = 100 * 1024 * 1024

_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
}
_BY_DTYPE = {v: k for k, v in _CODES.items()}
_NAMES = {str(d).removeprefix("torch."): d for d in _CODES.values()}
_ALIASES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "double": torch.float64,
}


def st_code(dtype: torch.dtype) -> str:
    """safetensors dtype code (``BF16``) of a torch dtype."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise CorruptCheckpointError(f"dtype {dtype} has no safetensors encoding") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Index spelling of a dtype: ``bfloat16``."""
    st_code(dtype)
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Parse ``bfloat16`` / ``torch.bfloat16`` / ``BF16`` / ``bf16``."""
    if not isinstance(name, str):
        raise CorruptCheckpointError(f"dtype must be a string, got {name!r}")
    key = name.removeprefix("torch.")
    for table in (_NAMES, _CODES, _ALIASES):
        if key in table:
            return table[key]
    raise CorruptCheckpointError(
        f"unknown dtype {name!r}: expected one of {', '.join(sorted(_NAMES))}"
    )


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class HeaderEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, kw_only=True)
class ParsedHeader:
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]
    data_start: int
    data_end: int


def encode_header(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Header bytes (length prefix included) for tensors laid out in the given order.

    Returns the bytes and each key's absolute (begin, end) byte range in the file.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    rel: dict[str, tuple[int, int]] = {}
    for key, dtype, shape in tensors:
        if key in rel or key == "__metadata__":
            raise CorruptCheckpointError(f"key {key!r} appears twice in one safetensors file")
        n = math.prod(shape) * itemsize(dtype)
        header[key] = {
            "dtype": st_code(dtype),
            "shape": list(shape),
            "data_offsets": [pos, pos + n],
        }
        rel[key] = (pos, pos + n)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces so data starts 8-byte aligned, as safetensors does.
    raw += b" " * (-(8 + len(raw)) % 8)
    start = 8 + len(raw)
    absolute = {k: (start + b, start + e) for k, (b, e) in rel.items()}
    return struct.pack("<Q", len(raw)) + raw, absolute


def parse_header(prefix: bytes, file_size: int, name: str) -> ParsedHeader | int:
    """Parse a header from the first bytes of a file of ``file_size`` bytes.

    Returns the number of bytes needed when ``prefix`` is too short, else the header.
    Raises :class:`CorruptCheckpointError` naming ``name`` on anything malformed.
    """
    if file_size < 8:
        raise CorruptCheckpointError(f"{name}: {file_size} bytes is too short for safetensors")
    if len(prefix) < 8:
        return 8
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > HEADER_LIMIT:
        raise CorruptCheckpointError(f"{name}: header length {n} exceeds the {HEADER_LIMIT} limit")
    if 8 + n > file_size:
        raise CorruptCheckpointError(
            f"{name}: header length {n} runs past the end of the file ({file_size} bytes)"
        )
    if len(prefix) < 8 + n:
        return 8 + n
    try:
        header = json.loads(prefix[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{name}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{name}: header is not a JSON object")
    data_start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptCheckpointError(f"{name}: __metadata__ must map strings to strings")
    entries: dict[str, HeaderEntry] = {}
    for key, info in header.items():
        where = f"{name}: tensor {key!r}"
        if not isinstance(info, dict):
            raise CorruptCheckpointError(f"{where} has no dtype/shape/data_offsets object")
        dtype = _CODES.get(info.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise CorruptCheckpointError(f"{where} has unknown dtype {info.get('dtype')!r}")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise CorruptCheckpointError(f"{where} has a bad shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise CorruptCheckpointError(f"{where} has bad data_offsets {offs!r}")
        want = math.prod(shape) * itemsize(dtype)
        if offs[1] - offs[0] != want:
            raise CorruptCheckpointError(
                f"{where}: data_offsets span {offs[1] - offs[0]} bytes but shape {shape} "
                f"of {dtype} needs {want}"
            )
        entries[key] = HeaderEntry(
            key=key,
            dtype=dtype,
            shape=tuple(shape),
            begin=data_start + offs[0],
            end=data_start + offs[1],
        )
    spans = sorted((e.begin, e.end, e.key) for e in entries.values() if e.end > e.begin)
    for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CorruptCheckpointError(f"{name}: data of {k0!r} and {k1!r} overlap")
    data_end = max((e.end for e in entries.values()), default=data_start)
    if data_end > file_size:
        raise CorruptCheckpointError(
            f"{name}: truncated — tensors need {data_end} bytes but the file has {file_size}"
        )
    return ParsedHeader(
        entries=entries, metadata=metadata, data_start=data_start, data_end=data_end
    )
