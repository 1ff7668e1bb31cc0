"""The cost model ``auto`` chooses a read strategy by.

    seconds = requests x latency / W + bytes read / storage bandwidth / W
              + bytes moved / exchange bandwidth

The storage's own figures come from its backend (local files: 50 us a request, 3 GB/s;
object stores: 30 ms, 500 MB/s), each overridable from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from reshard_svc.errors import UsageError
from reshard_svc.storage.base import Storage

__all__ = ["PlanFigures", "StorageCost"]


class PlanFigures(Protocol):
    """What the cost model reads of a plan (:class:`~reshard_svc.plan.read.ReadPlan` has
    it): its workers, its storage requests, the bytes each worker reads (over-reads
    included) and the bytes moved between workers."""

    @property
    def world(self) -> int: ...

    def reads_count(self) -> int: ...

    def bytes_read(self) -> Sequence[int]: ...

    def bytes_exchanged(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class StorageCost:
    """The cost model's inputs: the source storage's seconds per request and bytes per
    second, the exchange's bytes per second, and whether the storage is local files.

    Defaults come from the storage backend (``latency_s``, ``bandwidth``, ``local_files``);
    ``RESHARD_STORAGE_LATENCY_S``, ``RESHARD_STORAGE_BANDWIDTH`` and
    ``RESHARD_EXCHANGE_BANDWIDTH`` override them for a deployment that measured its own.
    """

    latency_s: float
    bandwidth: float
    exchange_bandwidth: float = 2.5e9  # gloo: ~2-3 GB/s per worker pair on one host
    local: bool = True

    @classmethod
    def of(cls, storage: Storage) -> StorageCost:
        def env(name: str, default: float) -> float:
            raw = os.environ.get(name)
            try:
                value = float(raw) if raw else default
            except ValueError:
                raise UsageError(f"{name}={raw!r} is not a number") from None
            if value <= 0:
                raise UsageError(f"{name}={raw!r} must be positive")
            return value

        return cls(
            latency_s=env("RESHARD_STORAGE_LATENCY_S", storage.latency_s),
            bandwidth=env("RESHARD_STORAGE_BANDWIDTH", storage.bandwidth),
            exchange_bandwidth=env("RESHARD_EXCHANGE_BANDWIDTH", cls.exchange_bandwidth),
            local=bool(storage.local_files),
        )

    def seconds(self, plan: PlanFigures) -> float:
        """Estimated wall time of ``plan``: requests and bytes read (over-reads included),
        spread over the workers, plus the bytes moved between them.

        cost = requests x latency / W + bytes read / bandwidth / W + bytes moved / exchange
        """
        w = max(1, plan.world)
        return (
            plan.reads_count() * self.latency_s / w
            + sum(plan.bytes_read()) / self.bandwidth / w
            + plan.bytes_exchanged() / self.exchange_bandwidth
        )
