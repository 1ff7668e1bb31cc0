"""Flatten nested state dicts to dotted keys and classify their values.

``{"model": {...}, "optim": {"state": {...}, "param_groups": [...]}}`` — what
``torch.distributed.checkpoint.state_dict.get_state_dict`` returns — flattens to
``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ... Tensors (plain, DTensor, ShardedTensor,
:class:`LocalShard`) are stored as tensors; JSON-able values go to the index's ``extras``; anything else is a
typed error naming the key. ``load`` flattens the caller's dict the same way and writes
values back through the recorded (parent, key) slots, so the nesting round-trips.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard_svc.errors import StateDictError
from reshard_svc.runtime import _compat

__all__ = ["Leaf", "LocalShard", "LocalShards", "flatten"]


@dataclass(frozen=True)
class LocalShard:
    """A plain tensor that holds one box of a larger global tensor, for code that knows
    its own layout (an inference engine, Megatron-style model code).

    ``tensor`` sits at ``offsets`` of a global tensor of ``global_shape``. ``valid`` (sizes
    from the local tensor's origin; default: all of it) is the part that is real data;
    the rest of ``tensor`` is declared padding (a vocabulary padded to a multiple of 64
    per rank): it is never saved or sent, and when loaded or transferred into it is
    filled with ``pad``, so it is never left uninitialised. Several ranks passing the
    same box hold replicas (KV heads replicated past their count), which must agree.
    Accepted wherever a DTensor is: ``save``, ``load`` (filled in place), ``transfer``.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    valid: tuple[int, ...] | None = None
    pad: float = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, torch.Tensor) or _compat.is_dtensor(self.tensor):
            raise StateDictError(
                f"LocalShard holds a plain local tensor, got {type(self.tensor).__name__}"
            )
        shape = tuple(self.tensor.shape)
        gshape = _ints("global_shape", self.global_shape)
        offsets = _ints("offsets", self.offsets)
        valid = shape if self.valid is None else _ints("valid", self.valid)
        if not len(gshape) == len(offsets) == len(valid) == len(shape):
            raise StateDictError(
                f"LocalShard of a {len(shape)}-D tensor needs {len(shape)} global_shape, "
                f"offsets and valid values; got {gshape}, {offsets}, {valid}"
            )
        for d, (g, o, v, n) in enumerate(zip(gshape, offsets, valid, shape)):
            if v > n:
                raise StateDictError(f"LocalShard valid {valid} exceeds the tensor's shape {shape}")
            if v and o + v > g:
                raise StateDictError(
                    f"LocalShard at offsets {offsets} with {valid} valid elements runs past "
                    f"the global shape {gshape} in dim {d}: if the rest is padding, say so "
                    f"with valid=(the real sizes)"
                )
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "valid", valid)

    @property
    def data(self) -> torch.Tensor:
        """The valid part of ``tensor`` (a view)."""
        return self.tensor[tuple(slice(0, v) for v in self.valid or ())]

    def padding(self) -> list[torch.Tensor]:
        """Views of ``tensor`` outside the valid part (slabs that partition the padding)."""
        valid = self.valid or tuple(self.tensor.shape)
        out = []
        for d in range(self.tensor.dim()):
            index = tuple(
                slice(0, valid[e]) if e < d else slice(valid[d], None) if e == d else slice(None)
                for e in range(self.tensor.dim())
            )
            slab = self.tensor[index]
            if slab.numel():
                out.append(slab)
        return out


@dataclass(frozen=True)
class LocalShards:
    """Several boxes of one global tensor held by one rank, each a :class:`LocalShard`
    (the parts of a checkpoint a rank restores from, a strided engine buffer): accepted
    wherever a :class:`LocalShard` is."""

    shards: tuple[LocalShard, ...]

    def __post_init__(self) -> None:
        shards = tuple(self.shards)
        if not shards or not all(isinstance(s, LocalShard) for s in shards):
            raise StateDictError("LocalShards holds one or more LocalShard")
        first = shards[0]
        for s in shards[1:]:
            if s.global_shape != first.global_shape or s.tensor.dtype != first.tensor.dtype:
                raise StateDictError(
                    "LocalShards: every shard is of one tensor (one global shape and dtype), "
                    f"got {first.global_shape}/{first.tensor.dtype} and "
                    f"{s.global_shape}/{s.tensor.dtype}"
                )
        object.__setattr__(self, "shards", shards)


def _ints(what: str, value: Any) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise StateDictError(
            f"LocalShard {what} must be a sequence of ints, got {value!r}"
        ) from None
    if any(v < 0 for v in out):
        raise StateDictError(f"LocalShard {what} {out} must not be negative")
    return out


@dataclass(kw_only=True)
class Leaf:
    """A leaf of a nested state dict: its dotted name, value and where it lives."""

    name: str
    value: Any
    parent: MutableMapping[Any, Any]
    key: Any

    @property
    def kind(self) -> str:
        if isinstance(self.value, LocalShard):
            return "local"
        if isinstance(self.value, LocalShards):
            return "locals"
        if _compat.is_dtensor(self.value):
            return "dtensor"
        if _compat.is_sharded_tensor(self.value):
            return "sharded"
        if isinstance(self.value, torch.Tensor):
            return "tensor"
        return "extra"


def flatten(state_dict: Mapping[Any, Any]) -> dict[str, Leaf]:
    """Dotted name -> leaf. Raises StateDictError on unsupported values or name clashes."""
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    out: dict[str, Leaf] = {}
    _walk(state_dict, "", out)
    return out


def _walk(d: Mapping[Any, Any], prefix: str, out: dict[str, Leaf]) -> None:
    for key, value in d.items():
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise StateDictError(
                f"key {prefix}{key!r} is a {type(key).__name__}: state dict keys must be "
                "strings (or ints)"
            )
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and not _is_tensor_like(value):
            if not value:
                _add(out, Leaf(name=name, value={}, parent=d, key=key))  # type: ignore[arg-type]
                continue
            _walk(value, name + ".", out)
            continue
        leaf = Leaf(name=name, value=value, parent=d, key=key)  # type: ignore[arg-type]
        if leaf.kind == "extra":
            _check_json(name, value)
        _add(out, leaf)


def _add(out: dict[str, Leaf], leaf: Leaf) -> None:
    if leaf.name in out:
        raise StateDictError(
            f"two entries flatten to the same name {leaf.name!r}: rename one of the keys"
        )
    out[leaf.name] = leaf


def _is_tensor_like(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _check_json(name: str, value: Any) -> None:
    def bad(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return True
        if isinstance(v, float) and not math.isfinite(v):
            return False  # json writes NaN/Infinity; python reads them back
        if isinstance(v, (list, tuple)):
            return any(bad(x) for x in v)
        if isinstance(v, Mapping):
            return any(bad(x) for x in v.values())
        return False

    if bad(value):
        raise StateDictError(
            f"state dict entry {name!r} nests tensors inside a list/tuple: store each "
            "tensor under its own dict key"
        )
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise StateDictError(
            f"state dict entry {name!r} is a {type(value).__name__}, which is neither a "
            f"tensor nor JSON-serializable ({e}); convert it or drop it"
        ) from None
