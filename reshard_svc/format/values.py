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

import bisect
import io
import re
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reshard_svc.errors import CorruptCheckpointError
from reshard_svc.format.index import Blob, CheckpointIndex
from reshard_svc.format.unpickle import TensorRef, inert_load
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
    return _plain(inert_load(data, f"opaque item {blob!r}: its pickle"), blob, 0)


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
    """The non-tensor values of one checkpoint (every caller rank). :meth:`prepare` reads
    and decodes the items the asked-for keys need, in one batch of ranged reads; then
    :meth:`get` answers each key."""

    def __init__(self, index: CheckpointIndex, storage: Storage, rank: int = 0) -> None:
        self.index, self.storage, self.rank = index, storage, rank
        self.flat = flat_values(index.extras)
        by_key: dict[str, list[Blob]] = {}
        for b in index.blobs.values():
            if b.encoding == "torch_save":
                by_key.setdefault(b.value_key, []).append(b)
        # several ranks' copies of one item: this rank's, else the lowest rank's
        self.blobs = {k: _mine(bs, rank) for k, bs in by_key.items()}
        self._sorted = sorted(self.flat)

    def prepare(self, names: Iterable[str]) -> None:
        """Decode every item that holds a value at, above or below one of ``names``."""
        wanted = set(names)
        above = {p for n in wanted for p in _prefixes(n)}
        todo = [
            b
            for key, b in sorted(self.blobs.items())
            if key == "" or key in above or any(p in wanted for p in _prefixes(key))
        ]
        small = [b for b in todo if b.nbytes <= _MAX_BLOB]
        raw = dict(zip((b.name for b in small), _read_checked(self.index, self.storage, small)))
        for b in todo:
            value = (
                decode_plain(raw[b.name], b.name)
                if b.name in raw
                else Opaque(f"item of {b.nbytes} bytes", b.name)
            )
            key = b.value_key
            found = (
                flat_values(value, key + "." if key else "")
                if isinstance(value, Mapping) and value
                else {key: value}
                if key
                else {}
            )
            for k, v in found.items():
                self.flat.setdefault(k, v)  # extras win over a pickled copy
        self._sorted = sorted(self.flat)

    def get(self, name: str, like: Any = None) -> tuple[bool, Any]:
        """(found, value) for key ``name``: the value stored at it, or everything stored
        under ``name.`` nested (as a list when ``like`` is one and the keys are 0..n-1).
        An :class:`Opaque` value is returned as is (the caller says what to do)."""
        if name in self.flat:
            return True, self.flat[name]
        lo = bisect.bisect_left(self._sorted, name + ".")
        hi = bisect.bisect_left(self._sorted, name + "/")  # "/" sorts right after "."
        if lo == hi:
            return False, None
        tree = _nest({k[len(name) + 1 :]: self.flat[k] for k in self._sorted[lo:hi]})
        return True, _listify(tree) if isinstance(like, (list, tuple)) else tree


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _mine(blobs: list[Blob], rank: int) -> Blob:
    if len(blobs) == 1:
        return blobs[0]
    ranked = {int(m.group(1)): b for b in blobs if (m := _RANK.search(b.name))}
    return ranked.get(rank) or ranked[min(ranked)] if ranked else min(blobs, key=lambda b: b.name)


def _read_checked(index: CheckpointIndex, storage: Storage, blobs: list[Blob]) -> list[bytes]:
    """The stored bytes of ``blobs`` (one batch of ranged reads), each block checked."""
    tables = index.block_tables()
    spans = []
    for b in blobs:
        table = tables.get(b.file)
        spans.append(table.widen(b.begin, b.end) if table else (b.begin, b.end))
    views = storage.read_ranges([(b.file, lo, hi) for b, (lo, hi) in zip(blobs, spans)])
    out = []
    for b, (lo, _), data in zip(blobs, spans, views):
        table = tables.get(b.file)
        if table:
            table.check(lo, data)
        out.append(bytes(data[b.begin - lo : b.end - lo]))
    return out


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
