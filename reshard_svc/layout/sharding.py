"""The layout core: which boxes of a global tensor each mesh coordinate holds.

Pure metadata — no process group, no I/O, no torch. The answers agree exactly with
torch's DTensor (``_compute_local_shape_and_global_offset`` and ``distribute_tensor``):

* ``Shard(d)`` splits like ``torch.chunk``: chunk size ``ceil(n / k)``, so trailing shards
  may be smaller or empty; an empty shard has size 0 and offset ``n`` in that dim.
* ``StridedShard(d, split_factor)`` is torch's ``_StridedShard``: the dim is first chunked
  into ``split_factor`` pieces, each piece is chunked over the mesh dim, and a rank holds
  its chunk of every piece — several boxes when the pieces are not adjacent.
* Placements apply left to right; a later placement on the same tensor dim splits the
  local index space left by the earlier ones.

Ranks are numbered row-major over mesh coordinates, as ``DeviceMesh`` numbers them.
"""

from __future__ import annotations

import itertools
import json
import zlib
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from reshard_svc.errors import LayoutError
from reshard_svc.layout.balance import least_loaded
from reshard_svc.layout.box import Box
from reshard_svc.layout.mesh import Mesh
from reshard_svc.layout.placements import (
    Placement,
    Replicate,
    Shard,
    StridedShard,
    parse_placements,
)

__all__ = ["Layout", "WriteItem", "choose_writers", "local_slices"]


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class WriteItem:
    """One distinct non-empty box of a tensor, who holds it and who writes it."""

    box: Box
    holders: tuple[int, ...]
    writer: int


Run = tuple[int, int]  # (start, length) of consecutive global indices along one dim


def _chunk(length: int, parts: int, index: int) -> Run:
    """``torch.chunk(length, parts)[index]`` as (start, length), empties padded."""
    c = -(-length // parts) if length else 0
    start = min(length, c * index)
    end = min(length, start + c)
    return start, max(0, end - start)


def _take(runs: list[Run], local: list[Run]) -> list[Run]:
    """Map local index sub-ranges (in the order the local tensor holds them) to global runs."""
    out: list[Run] = []
    for lstart, llen in local:
        if llen == 0:
            continue
        pos = 0
        for gstart, glen in runs:
            lo = max(lstart, pos)
            hi = min(lstart + llen, pos + glen)
            if hi > lo:
                g = gstart + (lo - pos)
                if out and out[-1][0] + out[-1][1] == g:
                    out[-1] = (out[-1][0], out[-1][1] + hi - lo)
                else:
                    out.append((g, hi - lo))
            pos += glen
            if pos >= lstart + llen:
                break
    return out


def _split(runs: list[Run], placement: Shard | StridedShard, parts: int, index: int) -> list[Run]:
    total = sum(n for _, n in runs)
    if isinstance(placement, StridedShard):
        local = []
        for j in range(placement.split_factor):
            ps, plen = _chunk(total, placement.split_factor, j)
            s, n = _chunk(plen, parts, index)
            local.append((ps + s, n))
    else:
        local = [_chunk(total, parts, index)]
    return _take(runs, local)


@dataclass(frozen=True)
class Layout:
    """A mesh plus one placement per mesh dim: how a global tensor is spread over ranks."""

    mesh: Mesh
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise LayoutError(f"Layout mesh must be a Mesh, got {self.mesh!r}")
        placements = parse_placements(self.placements)  # type: ignore[arg-type]
        object.__setattr__(self, "placements", placements)
        if len(placements) != self.mesh.ndim:
            raise LayoutError(
                f"{len(placements)} placements ({', '.join(map(str, placements))}) for a "
                f"{self.mesh.ndim}-D mesh ({self.mesh}): give exactly one placement per mesh dim"
            )

    # ---- construction / text forms

    @classmethod
    def replicated(cls) -> Layout:
        """A single-rank layout: the whole tensor in one box."""
        return cls(Mesh((1,)), (Replicate(),))

    @classmethod
    def parse(cls, mesh_text: str, placements_text: str | None = None) -> Layout:
        """``Layout.parse("dp=2,tp=4", "S(0),S(1)")`` or ``Layout.parse(str(layout))``."""
        if placements_text is None:
            if not isinstance(mesh_text, str) or "|" not in mesh_text:
                raise LayoutError(
                    f"layout text {mesh_text!r} must be 'MESH|PLACEMENTS', e.g. 'tp=4|S(0)'"
                )
            mesh_text, placements_text = mesh_text.split("|", 1)
        return cls(Mesh.parse(mesh_text), parse_placements(placements_text))

    def __str__(self) -> str:
        return f"{self.mesh}|{','.join(str(p) for p in self.placements)}"

    def to_json(self) -> dict[str, Any]:
        return {"mesh": self.mesh.to_json(), "placements": [str(p) for p in self.placements]}

    @classmethod
    def from_json(cls, data: Any) -> Layout:
        # Indexes repeat a handful of layouts thousands of times: parse each once.
        key = _layout_key(data)
        if key is not None:
            cached = _LAYOUTS.get(key)
            if cached is None:
                cached = _LAYOUTS[key] = cls._from_json(data)
                if len(_LAYOUTS) > 4096:
                    _LAYOUTS.clear()
            return cached
        return cls._from_json(data)

    @classmethod
    def _from_json(cls, data: Any) -> Layout:
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError:
                return cls.parse(data)
        if not isinstance(data, dict) or "mesh" not in data or "placements" not in data:
            raise LayoutError(f"layout JSON needs 'mesh' and 'placements', got {data!r}")
        placements = data["placements"]
        if not isinstance(placements, (list, str)):
            raise LayoutError(f"layout JSON 'placements' must be a list, got {placements!r}")
        return cls(Mesh.from_json(data["mesh"]), parse_placements(placements))

    # ---- geometry

    def normalized(self, ndim: int) -> tuple[Placement, ...]:
        """Placements with negative dims resolved against a tensor of ``ndim`` dims."""
        out: list[Placement] = []
        for i, p in enumerate(self.placements):
            if isinstance(p, Replicate):
                out.append(p)
                continue
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise LayoutError(
                    f"placement {p} on mesh dim {i} shards tensor dim {p.dim}, but the "
                    f"tensor has {ndim} dim(s): pick a dim in [0, {ndim})"
                )
            out.append(Shard(d) if isinstance(p, Shard) else StridedShard(d, p.split_factor))
        return tuple(out)

    def shards(self, global_shape: Sequence[int]) -> list[list[Box]]:
        """Every rank's boxes, indexed by flat rank. Empty shards are one zero-size box."""
        shape = _check_shape(global_shape)
        return [list(b) for b in _shards(self, shape)]

    def rank_boxes(self, global_shape: Sequence[int], rank: int) -> list[Box]:
        return list(_shards(self, _check_shape(global_shape))[rank])

    def local_shape(self, global_shape: Sequence[int], rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s local tensor (its boxes assembled in grid order)."""
        return _local_shape(_shards(self, _check_shape(global_shape))[rank])

    def write_items(
        self,
        global_shape: Sequence[int],
        itemsize: int = 1,
        load: MutableSequence[int] | None = None,
    ) -> list[WriteItem]:
        """Each distinct non-empty box once, with its holders and one writer.

        The writer is the holder with the fewest bytes assigned so far (``load``, per
        rank, updated in place so callers can balance across many tensors); ties break by
        a rotation derived from the box so equal replicated tensors spread over ranks.
        Every rank computes the same answer without communication.
        """
        shape = _check_shape(global_shape)
        world = self.mesh.size
        if load is None:  # a pure function of (layout, shape, itemsize): layers share it
            return list(_write_items(self, shape, itemsize))
        if len(load) < world:
            raise LayoutError(f"load has {len(load)} entries for a mesh of {world} ranks")
        holders: dict[Box, list[int]] = {}
        for rank, boxes in enumerate(_shards(self, shape)):
            for box in boxes:
                if not box.is_empty:
                    holders.setdefault(box, []).append(rank)
        writers = choose_writers(holders, shape, itemsize, load)
        return [WriteItem(b, tuple(holders[b]), writers[b]) for b in sorted(holders)]


@lru_cache(maxsize=256)
def _write_items(layout: Layout, shape: tuple[int, ...], itemsize: int) -> tuple[WriteItem, ...]:
    return tuple(layout.write_items(shape, itemsize, [0] * layout.mesh.size))


_LAYOUTS: dict[Any, Layout] = {}


def _layout_key(data: Any) -> Any:
    """A hashable key for layout JSON of the usual shape, or None."""
    try:
        mesh, pls = data["mesh"], data["placements"]
        key = (
            tuple(mesh["shape"]),
            tuple(mesh["names"]) if mesh.get("names") else None,
            tuple(pls) if isinstance(pls, list) else pls,
        )
        hash(key)
        return key
    except (TypeError, KeyError, AttributeError):
        return None


def choose_writers(
    holders: dict[Box, list[int]] | dict[Box, tuple[int, ...]],
    salt: Sequence[int],
    itemsize: int,
    load: MutableSequence[int],
) -> dict[Box, int]:
    """One writer per box: the least-loaded holder, biggest boxes first (the one rule,
    :func:`~reshard_svc.layout.balance.least_loaded`).

    Ties break by a rotation derived from ``salt`` (the global shape) and the box, so
    equal replicated tensors spread over ranks. ``load`` (bytes per rank) is updated in
    place; the answer depends only on the arguments, so every rank computes the same.
    """
    world = len(load)
    writers: dict[Box, int] = {}
    for box in sorted(holders, key=lambda b: (-b.numel, b.offsets)):
        hs = holders[box]
        rot = zlib.crc32(repr((tuple(salt), box.offsets, box.sizes)).encode()) % world
        w = least_loaded(hs, load, turn=rot)
        load[w] += box.numel * itemsize
        writers[box] = w
    return writers


def _check_shape(global_shape: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(global_shape)
    except TypeError:
        raise LayoutError(f"global shape {global_shape!r} is not a sequence of ints") from None
    for i, s in enumerate(shape):
        if not isinstance(s, int) or isinstance(s, bool):
            try:
                s = int(s)  # torch.Size / numpy ints
            except (TypeError, ValueError):
                raise LayoutError(f"global shape {shape}: dim {i} is not an int") from None
        if s < 0:
            raise LayoutError(f"global shape {shape}: dim {i} is negative ({s})")
    return tuple(int(s) for s in shape)


def local_slices(boxes: Sequence[Box]) -> list[tuple[slice, ...]]:
    """Where each of a rank's boxes sits inside that rank's local tensor.

    A rank's local tensor is its boxes assembled as a grid: along each dim, the distinct
    runs in increasing order. Returns one tuple of slices per box, in the same order.
    """
    if not boxes:
        return []
    ndim = boxes[0].ndim
    starts: list[dict[int, int]] = []
    for d in range(ndim):
        runs = sorted({(b.offsets[d], b.sizes[d]) for b in boxes})
        pos, where = 0, {}
        for off, size in runs:
            where[off] = pos
            pos += size
        starts.append(where)
    return [
        tuple(
            slice(starts[d][b.offsets[d]], starts[d][b.offsets[d]] + b.sizes[d])
            for d in range(ndim)
        )
        for b in boxes
    ]


def _local_shape(boxes: Sequence[Box]) -> tuple[int, ...]:
    first = boxes[0]
    if len(boxes) == 1:
        return first.sizes
    shape = []
    for d in range(first.ndim):
        starts: dict[int, int] = {}
        for b in boxes:
            starts[b.offsets[d]] = b.sizes[d]
        shape.append(sum(starts.values()))
    return tuple(shape)


@lru_cache(maxsize=4096)
def _shards(layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[Box, ...], ...]:
    ndim = len(shape)
    placements = layout.normalized(ndim)
    mesh = layout.mesh
    # Per-dim runs depend only on the coordinates of the mesh dims sharding that dim.
    per_dim_cache: dict[tuple[int, tuple[int, ...]], list[Run]] = {}
    sharding_mesh_dims = [
        [i for i, p in enumerate(placements) if not isinstance(p, Replicate) and p.dim == d]
        for d in range(ndim)
    ]
    result: list[tuple[Box, ...]] = []
    for rank in range(mesh.size):
        coord = mesh.coordinate(rank)
        dim_runs: list[list[Run]] = []
        for d in range(ndim):
            key = (d, tuple(coord[i] for i in sharding_mesh_dims[d]))
            runs = per_dim_cache.get(key)
            if runs is None:
                runs = [(0, shape[d])]
                for i in sharding_mesh_dims[d]:
                    p = placements[i]
                    runs = _split(runs, p, mesh.shape[i], coord[i])  # type: ignore[arg-type]
                per_dim_cache[key] = runs
            dim_runs.append(runs)
        if any(sum(n for _, n in r) == 0 for r in dim_runs):
            # torch reports an empty shard's offset as the dim size where it was emptied.
            offs = tuple(
                (r[0][0] if r and sum(n for _, n in r) else shape[d])
                if sharding_mesh_dims[d]
                else 0
                for d, r in enumerate(dim_runs)
            )
            sizes = tuple(sum(n for _, n in r) for r in dim_runs)
            result.append((Box(offs, sizes),))
            continue
        boxes = tuple(
            Box(tuple(r[0] for r in combo), tuple(r[1] for r in combo))
            for combo in itertools.product(*dim_runs)
        )
        result.append(boxes)
    return tuple(result)
