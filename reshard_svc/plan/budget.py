"""A worker's byte budget (``max_memory``), parsed once, with its shares named.

Every verb that moves data holds at most its budget in flight on each worker: ``convert``,
``load``, ``transfer`` and a :class:`~reshard_svc.WeightSync`. The text a person types
(``1GiB``, ``512MB``, ``1e9``) or an int is parsed here, once, into a :class:`Budget`; each
user takes its share by name, never by a divisor of its own:

* :attr:`Budget.band` — one global row band of a tensor (a quarter: its read, what it sends,
  what it receives and its target buffer are each about one band);
* :attr:`Budget.writer` — what a convert's background writer may queue (a quarter);
* :attr:`Budget.buffers` — a convert's pooled band buffers (a half);
* :attr:`Budget.total` — a wave: every rank's in-flight bytes, summed over its items.

:data:`DEFAULTS` holds the one default of each verb.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from reshard_svc.errors import UsageError

__all__ = ["DEFAULTS", "Budget", "Verb", "parse_size"]

Verb = Literal["convert", "load", "transfer"]

#: The budget of each verb when none is given: a convert streams bands to its writers, so
#: it takes more; a load or a transfer lands in the caller's own tensors.
DEFAULTS: dict[str, int] = {
    "convert": 1024**3,
    "load": 512 * 1024**2,
    "transfer": 512 * 1024**2,
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]\+?(\d+))?\s*([A-Za-z]*)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_size(text: str | int | None, what: str = "size") -> int | None:
    """``1GiB``, ``1Gi`` (Kubernetes), ``512MB``, ``1e9`` or an int -> a positive byte count."""
    if text is None:
        return None
    if isinstance(text, bool):
        raise UsageError(f"{what} {text!r} must be a byte count or a size like 1GiB")
    if isinstance(text, int):
        if text <= 0:
            raise UsageError(f"{what} {text} must be positive")
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(3).lower() not in _UNITS:
        raise UsageError(
            f"{what} {text!r} is not a size: use a positive number and a unit, e.g. 512MiB or 1GiB"
        )
    value = float(m.group(1)) * 10 ** int(m.group(2) or 0) * _UNITS[m.group(3).lower()]
    if not math.isfinite(value) or value < 1:
        raise UsageError(f"{what} {text!r} must be at least one byte")
    return int(value)


@dataclass(frozen=True, slots=True)
class Budget:
    """``total`` bytes a worker may hold in flight; the shares its users take are named
    here (see the module doc). Build one with :meth:`of`."""

    total: int

    def __post_init__(self) -> None:
        if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total < 1:
            raise UsageError(f"max_memory must be a positive number of bytes, got {self.total!r}")

    @classmethod
    def of(cls, value: Budget | str | int | None, verb: Verb) -> Budget:
        """``value`` as typed (``1GiB``), as an int, or None for ``verb``'s default."""
        if isinstance(value, Budget):
            return value
        parsed = parse_size(value, "max_memory")
        return cls(DEFAULTS[verb] if parsed is None else parsed)

    @property
    def band(self) -> int:
        """Bytes of one global row band (its read, send, receive and target each ~one)."""
        return max(1, self.total // 4)

    @property
    def writer(self) -> int:
        """Bytes a convert's background writer may queue."""
        return max(1, self.total // 4)

    @property
    def buffers(self) -> int:
        """Bytes of a convert's pooled band buffers."""
        return max(1, self.total // 2)
