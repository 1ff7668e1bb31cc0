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

A rank's I/O threads (``io_threads``: its checking writers and readers) are parsed here
too, once, by :func:`io_threads`: a count given to a verb, else ``RESHARD_IO_THREADS``,
else what the host gives this rank (the CPUs this process may use, shared by the ranks on
its node, at most :data:`MAX_IO_THREADS`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Literal

from reshard_svc.errors import UsageError

__all__ = [
    "DEFAULTS",
    "IO_THREADS_ENV",
    "MAX_IO_THREADS",
    "Budget",
    "Verb",
    "io_threads",
    "parse_size",
]

#: A rank's I/O threads when a verb is given none (a count).
IO_THREADS_ENV = "RESHARD_IO_THREADS"
#: The most I/O threads a rank takes by itself (storage rarely gains past it).
MAX_IO_THREADS = 16

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


def io_threads(value: int | str | None = None) -> int:
    """A rank's I/O thread count: ``value`` (an int or its text), else
    ``RESHARD_IO_THREADS``, else the CPUs this process may use divided among the ranks on
    its node (``LOCAL_WORLD_SIZE``), between 1 and :data:`MAX_IO_THREADS`. Zero, a
    negative number or text that is not a count is a :class:`UsageError` naming it."""
    where = "io_threads"
    if value is None and os.environ.get(IO_THREADS_ENV, "").strip():
        value, where = os.environ[IO_THREADS_ENV], IO_THREADS_ENV
    if value is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        try:
            ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            ranks = 1
        return max(1, min(MAX_IO_THREADS, cpus // ranks))
    count: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str) and value.strip().isdigit():
        count = int(value.strip())
    if count is None or count < 1:
        raise UsageError(f"{where} must be a count of threads (1 or more), got {value!r}")
    return count
