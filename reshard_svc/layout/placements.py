"""Placements: ``Replicate``, ``Shard(d)`` and ``StridedShard(d, k)``, and their text forms.

Text is ``R``, ``S(d)`` or ``SS(d,k)``; torch's spellings (``Shard(dim=0)``,
``_StridedShard(dim=0, sf=2)``) are accepted too. Re-exported by :mod:`reshard_svc.layout`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Union

from reshard_svc.errors import LayoutError

__all__ = [
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "parse_placement",
    "parse_placements",
    "split_top_level",
]


@dataclass(frozen=True)
class Replicate:
    """Every coordinate along the mesh dim holds the whole (remaining) tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """``torch.chunk``-style split of tensor dim ``dim`` over the mesh dim."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise LayoutError(f"Shard dim must be an int, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class StridedShard:
    """torch's ``_StridedShard(dim, split_factor)``: right-to-left sharding, e.g. FSDP2 x TP."""

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise LayoutError(f"StridedShard dim must be an int, got {self.dim!r}")
        if (
            not isinstance(self.split_factor, int)
            or isinstance(self.split_factor, bool)
            or self.split_factor < 1
        ):
            raise LayoutError(
                f"StridedShard split_factor must be an int >= 1, got {self.split_factor!r}"
            )

    def __str__(self) -> str:
        return f"SS({self.dim},{self.split_factor})"


Placement = Union[Replicate, Shard, StridedShard]
_PLACEMENT_TYPES = (Replicate, Shard, StridedShard)

_PLACEMENT_RE = re.compile(
    r"""^\s*(?:
        (?P<r>R|Replicate)\s*(?:\(\s*\))? |
        (?P<ss>SS|StridedShard|_StridedShard)\s*\(\s*(?:dim\s*=\s*)?(?P<ssd>-?\d+)\s*,\s*
            (?:(?:sf|split_factor)\s*=\s*)?(?P<ssk>\d+)\s*\) |
        (?P<s>S|Shard)\s*\(\s*(?:dim\s*=\s*)?(?P<sd>-?\d+)\s*\)
    )\s*$""",
    re.IGNORECASE | re.VERBOSE,
)


def parse_placement(text: str) -> Placement:
    """Parse ``R``, ``S(d)`` or ``SS(d,k)`` (torch spellings are accepted too)."""
    if not isinstance(text, str):
        raise LayoutError(f"placement must be text such as 'S(0)', got {text!r}")
    return _parse_placement(text)


@lru_cache(maxsize=1024)
def _parse_placement(text: str) -> Placement:
    m = _PLACEMENT_RE.match(text)
    if m is None:
        raise LayoutError(f"unknown placement {text!r}: use R, S(dim) or SS(dim,split_factor)")
    if m.group("r"):
        return Replicate()
    if m.group("ss"):
        return StridedShard(int(m.group("ssd")), int(m.group("ssk")))
    return Shard(int(m.group("sd")))


def split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def parse_placements(text: str | Sequence[str | Placement]) -> tuple[Placement, ...]:
    """Parse ``"S(0),R"`` or a list of placement texts/objects."""
    items: Iterable[str | Placement]
    if isinstance(text, tuple) and all(isinstance(p, _PLACEMENT_TYPES) for p in text):
        return text  # already parsed (Layout re-validates its own placements)
    if isinstance(text, str):
        stripped = text.strip().strip("[]")
        if not stripped:
            raise LayoutError("placements are empty: give one per mesh dim, e.g. 'S(0),R'")
        items = split_top_level(stripped)
    else:
        items = text
    out: list[Placement] = []
    for item in items:
        if isinstance(item, (Replicate, Shard, StridedShard)):
            out.append(item)
        else:
            out.append(parse_placement(item))
    return tuple(out)
