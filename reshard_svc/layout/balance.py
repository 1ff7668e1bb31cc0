"""The one rule for choosing which holder does a job: who writes a box on save, who reads a
stored chunk, who sends a transfer's bytes.

Prefer the candidate with the most ``prefer`` bytes (work it saves: bytes it would
otherwise receive), then the one with the least ``load`` so far, then rotate among those
still tied by ``turn``. Pure and deterministic: every rank computes the same choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["least_loaded"]


def least_loaded(
    candidates: Sequence[int],
    load: Sequence[int],
    *,
    prefer: Mapping[int, int] | None = None,
    turn: int = 0,
) -> int:
    """The chosen candidate rank (``candidates`` must not be empty)."""
    if prefer:
        best = max((prefer.get(r, 0), -load[r]) for r in candidates)
        tied = sorted(r for r in candidates if (prefer.get(r, 0), -load[r]) == best)
    else:
        low = min(load[r] for r in candidates)
        tied = sorted(r for r in candidates if load[r] == low)
    return tied[turn % len(tied)]
