"""A device mesh: its shape, optional dim names, and row-major rank numbering (as
``DeviceMesh`` numbers ranks). Re-exported by :mod:`reshard_svc.layout`."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reshard_svc.errors import LayoutError

__all__ = ["MAX_MESH_SIZE", "Mesh"]

#: Largest world a mesh may span (beyond any real job; keeps hostile metadata bounded).
MAX_MESH_SIZE = 1 << 20


@dataclass(frozen=True)
class Mesh:
    """A device mesh shape with optional dim names; ranks are row-major coordinates."""

    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.shape, int):
            object.__setattr__(self, "shape", (self.shape,))
        shape = tuple(self.shape)
        if not shape:
            raise LayoutError("mesh shape is empty: give at least one dim, e.g. tp=4")
        for i, s in enumerate(shape):
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                raise LayoutError(
                    f"mesh dim {i} has size {s!r}: every mesh size must be a positive int"
                )
        object.__setattr__(self, "shape", shape)
        if math.prod(shape) > MAX_MESH_SIZE:
            raise LayoutError(
                f"mesh {shape} spans {math.prod(shape)} ranks; at most {MAX_MESH_SIZE} are supported"
            )
        if self.names is not None:
            names = tuple(self.names)
            if len(names) != len(shape):
                raise LayoutError(
                    f"mesh names {names} do not match mesh shape {shape}: one name per dim"
                )
            if len(set(names)) != len(names):
                raise LayoutError(f"mesh names {names} repeat a name")
            for n in names:
                if not isinstance(n, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n):
                    raise LayoutError(f"mesh dim name {n!r} must be an identifier")
            object.__setattr__(self, "names", names)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """The world size this mesh spans."""
        return math.prod(self.shape)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.size:
            raise LayoutError(f"rank {rank} is outside a mesh of {self.size} ranks")
        coord = []
        for s in reversed(self.shape):
            coord.append(rank % s)
            rank //= s
        return tuple(reversed(coord))

    def rank_of(self, coord: Sequence[int]) -> int:
        rank = 0
        for c, s in zip(coord, self.shape):
            rank = rank * s + c
        return rank

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """``"dp=2,tp=4"`` (named), ``"2,4"`` or ``"2x4"`` (unnamed)."""
        if not isinstance(text, str) or not text.strip():
            raise LayoutError(f"mesh text {text!r} is empty: use e.g. 'tp=4' or 'dp=2,tp=4'")
        parts = [p.strip() for p in re.split(r"[,x×]", text.strip())]
        names: list[str] = []
        shape: list[int] = []
        for p in parts:
            name, eq, size = p.partition("=")
            size_text = size if eq else name
            try:
                value = int(size_text.strip())
            except ValueError:
                raise LayoutError(
                    f"mesh text {text!r}: {p!r} is not 'name=size' or a size"
                ) from None
            if eq:
                names.append(name.strip())
            shape.append(value)
        if names and len(names) != len(shape):
            raise LayoutError(f"mesh text {text!r} names some dims but not all")
        return cls(tuple(shape), tuple(names) if names else None)

    def __str__(self) -> str:
        if self.names is None:
            return ",".join(str(s) for s in self.shape)
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.shape))

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "names": list(self.names) if self.names else None}

    @classmethod
    def from_json(cls, data: Any) -> Mesh:
        if isinstance(data, str):
            return cls.parse(data)
        if not isinstance(data, dict) or "shape" not in data:
            raise LayoutError(f"mesh JSON must be an object with 'shape', got {data!r}")
        shape = data["shape"]
        if not isinstance(shape, list):
            raise LayoutError(f"mesh JSON 'shape' must be a list, got {shape!r}")
        names = data.get("names")
        if names is not None and not isinstance(names, list):
            raise LayoutError(f"mesh JSON 'names' must be a list or null, got {names!r}")
        return cls(tuple(shape), tuple(names) if names else None)
