"""One cache of plans, shared by ``load``, ``convert`` and ``transfer``.

Entries are keyed by a plan's *whole* inputs (tuples compared by equality, never trusted
by hash alone), so a hit is exactly the plan those inputs give. The newest entries are
kept; access is thread-safe (``async_save`` and training threads may plan at once).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["PlanCache", "SampledKey"]

V = TypeVar("V")


class PlanCache(Generic[V]):
    """The last ``maxsize`` plans (or anything a planner keeps with them), newest last."""

    def __init__(self, maxsize: int = 8) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
            return hit

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def get_or_build(
        self, key: Hashable, build: Callable[[], V], digest: Hashable | None = None
    ) -> V:
        """The cached value for ``key``, or ``build()`` kept for next time (``key`` is
        hashed once for both: a 1T model's chunk lists take 0.15 s to hash). ``digest``,
        when given, is hashed in its place: a part of the key that tells most keys apart
        (keys are still compared whole, so a digest shared by unequal keys costs only a
        comparison)."""
        key = _HashedOnce(key, digest)
        hit = self.get(key)
        if hit is None:
            hit = build()
            self.put(key, hit)
        return hit

    def values(self) -> list[V]:
        """The kept values, oldest first."""
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        """Drop every entry (and whatever buffers they keep)."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class SampledKey(tuple):  # type: ignore[type-arg]
    """A tuple of immutable items hashed, once, by a sample of them: each item that is a
    long tuple (a tensor's chunk list, its target boxes, their holders) gives its length
    and five items spread over it, not every one. A 1T model's per-tensor keys hold 1.6 M
    chunks: hashing them whole took 0.28 s a plan, and comparing, whole, the keys whose
    hashes meet takes 0.05 s. Equal keys have equal samples, so equal hashes; a key equals
    only another :class:`SampledKey` (a plain tuple is hashed otherwise)."""

    def __hash__(self) -> int:
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = hash(tuple(map(_sample, self)))
        return int(h)

    def __eq__(self, other: object) -> bool:
        return type(other) is SampledKey and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)


def _sample(item: object) -> object:
    if type(item) is tuple and len(item) > 8:
        n = len(item)
        return (n, item[0], item[n // 4], item[n // 2], item[3 * n // 4], item[-1])
    return item


class _HashedOnce:
    """A key whose hash is computed once; equal to the same key, wrapped or not."""

    __slots__ = ("hash", "key")
    key: Hashable
    hash: int

    def __init__(self, key: Hashable, digest: Hashable | None = None) -> None:
        self.key = key.key if isinstance(key, _HashedOnce) else key
        self.hash = hash(self.key if digest is None else digest)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _HashedOnce):
            return self.hash == other.hash and (self.key is other.key or self.key == other.key)
        return bool(self.key == other)
