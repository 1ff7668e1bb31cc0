"""A checkpoint's non-tensor values, under the state-dict keys a loader asks for.

One mapping, used by ``load`` (which fills a state dict's non-tensor entries) and
``convert`` (which writes the extras it carries flat, as ``save`` does, and carries the
opaque items with their keys), so a converted checkpoint loads as its source does. The
values come from:

* ``extras``: JSON values; nested objects (torch_checkpointing's ``{"optim":
  {"param_groups": [...]}}``) are walked as a state dict is flattened, so they answer the
  dotted key ``optim.param_groups`` that our own format stores;
* opaque ``torch_save`` items (:class:`~reshard_svc.format.index.Blob`): torch DCP's
  non-tensor entries (``optimizer.param_groups.<fqn>.lr``, ``train_state.step``),
  Megatron-Core's ``common.pt`` (its values sit at the root: ``iteration``,
  ``optimizer.param_groups``), torch_checkpointing's items saved without a resharder (a
  rank gets its own copy). Their pickles are walked by an unpickler that imports and runs
  nothing (:mod:`reshard_svc.format.torch_save`); only plain data — None, bools, ints,
  floats, strings, bytes, lists, tuples and dicts of them, as ``weights_only`` builds —
  becomes a value. Anything else is an :class:`Opaque` stand-in naming its type, and asking
  for it is an error that says so (read it with ``read_blob``), never "missing".

DCP flattens lists to indexed keys (``optim.param_groups.0.lr``): asked for as a list, such
keys come back as one.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard_svc.errors import CorruptCheckpointError
from reshard_svc.format.index import Blob, CheckpointIndex
from reshard_svc.format.torch_save import TensorRef, inert_load
from reshard_svc.storage import Storage

__all__ = ["Opaque", "StoredValues", "decode_plain", "flat_values", "opaque_in"]

_MAX_DEPTH = 64
_MAX_BLOB = 64 * 1024 * 1024  # a value item larger than this stays opaque (not decoded)
_RANK = re.compile(r"/rank(\d+)$")


@dataclass(frozen=True)
class Opaque:
    """A stored value that is not plain data: its pickled type, and the item holding it."""

    type_name: str
    blob: str


def flat_values(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value, walking nested dicts as a state dict is flattened (a non-empty
    dict is a level; lists, tuples, scalars and empty dicts are values)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_values(value, name + "."))
        else:
            out[name] = value
    return out


def decode_plain(raw: bytes, blob: str) -> Any:
    """The value a ``torch.save`` stream holds, built without running its pickle: plain data
    as itself, anything else as :class:`Opaque`."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            pkl = [n for n in z.namelist() if n.endswith("data.pkl")]
            if len(pkl) != 1:
                raise CorruptCheckpointError(f"opaque item {blob!r} is not a torch.save stream")
            data = z.read(pkl[0])
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CorruptCheckpointError(f"opaque item {blob!r} is not a torch.save stream: {e}") from e
    try:
        tree = inert_load(data)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, RecursionError, MemoryError) as e:  # fmt: skip
        raise CorruptCheckpointError(f"opaque item {blob!r}: its pickle is unreadable: {e}") from e
    return _plain(tree, blob, 0)


def _plain(node: Any, blob: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CorruptCheckpointError(f"opaque item {blob!r} nests deeper than {_MAX_DEPTH} levels")
    if node is None or isinstance(node, (bool, int, float, str, bytes)):
        return node
    if isinstance(node, dict):
        return {str(k): _plain(v, blob, depth + 1) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_plain(v, blob, depth + 1) for v in node)
    if isinstance(node, TensorRef):
        return Opaque("Tensor", blob)
    return Opaque(type(node).__name__, blob)


class StoredValues:
    """The non-tensor values of one checkpoint, decoded on demand (every caller rank)."""

    def __init__(self, index: CheckpointIndex, storage: Storage, rank: int = 0) -> None:
        self.index, self.storage, self.rank = index, storage, rank
        self.flat = flat_values(index.extras)
        self._decoded: set[str] = set()
        by_key: dict[str, list[Blob]] = {}
        for b in index.blobs.values():
            if b.encoding == "torch_save":
                by_key.setdefault(b.value_key, []).append(b)
        # several ranks' copies of one item: this rank's, else the lowest rank's
        self.blobs = {k: _mine(bs, rank) for k, bs in by_key.items()}

    def get(self, name: str, like: Any = None) -> tuple[bool, Any]:
        """(found, value) for key ``name``: the value stored at it, or everything stored
        under ``name.`` nested (as a list when ``like`` is one and the keys are 0..n-1).
        An :class:`Opaque` value is returned as is (the caller says what to do)."""
        self._decode_for(name)
        if name in self.flat:
            return True, self.flat[name]
        nested = {k[len(name) + 1 :]: v for k, v in self.flat.items() if k.startswith(name + ".")}
        if not nested:
            return False, None
        tree = _nest(nested)
        return True, _listify(tree) if isinstance(like, (list, tuple)) else tree

    def _decode_for(self, name: str) -> None:
        for key in self.blobs:
            if key == name or key == "" or key.startswith(name + ".") or name.startswith(key + "."):
                self._decode(key)

    def _decode(self, key: str) -> None:
        if key in self._decoded:
            return
        self._decoded.add(key)
        b = self.blobs[key]
        if b.nbytes > _MAX_BLOB:
            value: Any = Opaque(f"item of {b.nbytes} bytes", b.name)
        else:
            value = decode_plain(_read_checked(self.index, self.storage, b), b.name)
        if isinstance(value, Mapping) and value:
            found = flat_values(value, key + "." if key else "")
        else:
            found = {key: value} if key else {}
        for k, v in found.items():
            self.flat.setdefault(k, v)  # extras win over a pickled copy


def _mine(blobs: list[Blob], rank: int) -> Blob:
    if len(blobs) == 1:
        return blobs[0]
    ranked = {int(m.group(1)): b for b in blobs if (m := _RANK.search(b.name))}
    return ranked.get(rank) or ranked[min(ranked)] if ranked else min(blobs, key=lambda b: b.name)


def _read_checked(index: CheckpointIndex, storage: Storage, blob: Blob) -> bytes:
    table = index.block_tables().get(blob.file)
    lo, hi = table.widen(blob.begin, blob.end) if table else (blob.begin, blob.end)
    data = storage.read_view(blob.file, lo, hi)
    if table:
        table.check(lo, data)
    return bytes(data[blob.begin - lo : blob.end - lo])


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _listify(tree: Any) -> Any:
    """Dicts keyed 0..n-1 (how DCP flattens a list) back into lists, all the way down."""
    if isinstance(tree, dict):
        items = {k: _listify(v) for k, v in tree.items()}
        if (
            items
            and all(k.isdigit() for k in items)
            and sorted(map(int, items)) == list(range(len(items)))
        ):
            return [items[str(i)] for i in range(len(items))]
        return items
    return tree


def opaque_in(value: Any) -> Opaque | None:
    """The first :class:`Opaque` inside ``value``, if any."""
    if isinstance(value, Opaque):
        return value
    children = (
        value.values()
        if isinstance(value, Mapping)
        else value
        if isinstance(value, (list, tuple))
        else ()
    )
    for v in children:
        if (found := opaque_in(v)) is not None:
            return found
    return None
