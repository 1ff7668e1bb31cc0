"""Every unpickler reshard_svc uses, together: none runs what a file names.

- :class:`AllowListUnpickler` — torch DCP's ``.metadata``: resolves only the handful of
  torch metadata classes, dtypes and path types a DCP save really contains
  (:data:`ALLOWED`); anything else raises :class:`~reshard_svc.errors.UnsafePickleError`.
- :class:`PlainUnpickler` — torch_checkpointing's ``metadata.pkl``: builtins only; any
  global at all is refused.
- :class:`InertUnpickler` — a ``torch.save`` ``data.pkl`` (torch_checkpointing's rank
  files, DCP's and Megatron's pickled values): imports and runs nothing; tensor rebuilds
  become :class:`TensorRef` (record, offset, shape, stride), every other global an inert
  stand-in. :mod:`reshard_svc.format.values` keeps the plain data of what it builds.

Nothing here calls ``pickle.load`` or ``torch.load`` without ``weights_only``.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc.errors import CorruptCheckpointError, UnsafePickleError

__all__ = [
    "ALLOWED",
    "AllowListUnpickler",
    "InertUnpickler",
    "PlainUnpickler",
    "TensorRef",
    "inert_load",
    "read_ints",
    "safe_unpickle",
]

# ---------------------------------------------------------------- DCP .metadata, allow-listed

_MD = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_MD, "Metadata"),
        (_MD, "TensorStorageMetadata"),
        (_MD, "BytesStorageMetadata"),
        (_MD, "ChunkStorageMetadata"),
        (_MD, "TensorProperties"),
        (_MD, "MetadataIndex"),
        (_MD, "StorageMeta"),
        (_MD, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # Megatron-Core's torch_dist backend caches its save plans in the metadata
        # (inert dataclasses of offsets and sizes).
        (_PLANNER, "SavePlan"),
        (_PLANNER, "WriteItem"),
        (_PLANNER, "WriteItemType"),
        (_PLANNER, "TensorWriteData"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class AllowListUnpickler(pickle.Unpickler):
    """Resolves only allow-listed globals (plus torch dtypes); everything else raises."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickleError(
            f"DCP metadata names {module}.{name}, which is not on the allow-list; refusing "
            "to unpickle it"
        )


def safe_unpickle(raw: bytes) -> Any:
    try:
        return AllowListUnpickler(io.BytesIO(raw)).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # malformed pickles raise many types
        raise CorruptCheckpointError(f".metadata is not a readable DCP pickle: {e}") from e


# ---------------------------------------------------------------- plain data only


class PlainUnpickler(pickle.Unpickler):
    """Builds only builtins (torch_checkpointing's ``metadata.pkl``): any global is refused,
    whatever it names, and so is any persistent object."""

    def __init__(self, file: Any, what: str) -> None:
        super().__init__(file)
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(
            f"{self.what} names {module}.{name}; it should hold only plain data, so it is "
            "refused unread"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self.what} refers to persistent objects; refused")


# ---------------------------------------------------------------- data.pkl, read inertly


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None
    numel: int


@dataclass(frozen=True, kw_only=True)
class TensorRef:
    """Where a local tensor's bytes are: record ``data/<key>``, element offset, shape, stride."""

    key: str
    dtype: torch.dtype | None
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Inert:
    """Whatever a pickle builds that we do not model: accepts anything, means nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()


class _InertType(type):
    """A stand-in for a named class: constructing or calling it yields an inert object of
    the stand-in's type (so its name can be reported)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__()


_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype | None


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> Any:
    if not isinstance(storage, _StorageRef):
        return _Inert()
    return TensorRef(
        key=storage.key,
        dtype=storage.dtype,
        offset=int(offset),
        size=read_ints(size),
        stride=read_ints(stride),
    )


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """A tensor subclass (DTensor): what we need is its ``_local_tensor``."""
    # state is the instance dict, or (dict, slots) as copyreg builds it
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, dict) and isinstance(part.get("_local_tensor"), TensorRef):
            return part["_local_tensor"]
    return func(*args) if callable(func) else _Inert()


def read_ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        return (-1,)  # refused where used: a shape or stride must be non-negative ints
    return tuple(value)


class _Dict(dict):  # type: ignore[type-arg]
    """An OrderedDict; a state dict's carries a ``_metadata`` attribute, ignored."""

    def __setstate__(self, state: Any) -> None:
        pass


_MEANINGFUL: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Size"): tuple,
    ("collections", "OrderedDict"): _Dict,
}


class InertUnpickler(pickle.Unpickler):
    """Walks a ``torch.save`` ``data.pkl`` without importing or running anything it names.

    Only tensor rebuilds get a meaning (a :class:`TensorRef`); every other global becomes
    an inert stand-in, so the result is the pickled container structure with TensorRefs at
    the tensor leaves and inert objects elsewhere."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _MEANINGFUL:
            return _MEANINGFUL[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return _InertType(f"{module}.{name}", (_Inert,), {})

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            return _Inert()
        _, stype, key, _location, numel = pid
        dtype = stype.dtype if isinstance(stype, _StorageType) else None
        if not isinstance(key, str) or not isinstance(numel, int):
            return _Inert()
        return _StorageRef(key, dtype, numel)


#: What a malformed pickle raises while it is walked (none of it is run).
_MALFORMED = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    AttributeError,
    RecursionError,
    MemoryError,
)


def inert_load(data: bytes, what: str = "data.pkl") -> Any:
    """A ``data.pkl`` walked by :class:`InertUnpickler` (nothing imported or run); a
    malformed one is a :class:`CorruptCheckpointError` naming ``what``."""
    try:
        return InertUnpickler(io.BytesIO(data)).load()
    except _MALFORMED as e:
        raise CorruptCheckpointError(f"{what} is unreadable: {e}") from e
