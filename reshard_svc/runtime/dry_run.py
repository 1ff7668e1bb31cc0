"""A dry run: size a conversion (or a load) for any number of workers, on one machine.

:func:`dry_run` reads only the source's index and runs the planner the workers run —
the same output plan, read plan and waves — for ``world`` workers, without a process
group and without touching the target. It reports what each worker would do: bytes read
from storage, sent to and received from other workers (max and mean), its peak bytes in
flight in one wave (what ``max_memory`` bounds), the storage requests, the waves and the
strategy ``auto`` picks.

``load=True`` sizes ``reshard_svc.load`` by a job of ``world`` ranks whose tensors have
the target layouts (``mesh`` and ``rules``): every rank wants its own boxes, a replicated
tensor's box is wanted by all of its holders.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from reshard_svc.errors import UsageError
from reshard_svc.jobs.spec import ConvertSpec, Format
from reshard_svc.plan.items import Held
from reshard_svc.plan.read import ReadPlan, StorageCost, choose_plan
from reshard_svc.runtime.convert import Conversion

__all__ = ["DryRun", "Spread", "dry_run"]

#: the most workers a dry run plans for
MAX_DRY_RUN_WORLD = 65536
#: the most workers whose own figures a dry run lists (beyond: max and mean only)
PER_WORKER_MAX = 256


@dataclass(frozen=True)
class Spread:
    """A per-worker quantity over the workers."""

    max: int
    mean: float
    total: int

    @classmethod
    def of(cls, values: Sequence[int]) -> Spread:
        total = sum(values)
        return cls(max(values, default=0), total / len(values) if values else 0.0, total)

    @property
    def max_over_mean(self) -> float:
        return self.max / self.mean if self.mean else 1.0


@dataclass(frozen=True, kw_only=True)
class DryRun:
    mode: str  # convert or load
    source: str
    world: int
    strategy: str
    tensors: int
    bytes_total: int  # delivered into targets, over every worker
    budget: int  # max_memory per worker
    waves: int
    storage_requests: int
    read: Spread
    sent: Spread
    received: Spread
    peak_memory: Spread
    plan_s: float
    #: each worker's bytes read, sent and received, in rank order (for up to
    #: PER_WORKER_MAX workers; empty beyond)
    per_worker: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("read", "sent", "received", "peak_memory"):
            out[key]["max_over_mean"] = round(getattr(self, key).max_over_mean, 3)
        return out


def dry_run(
    spec: ConvertSpec,
    world: int | None = None,
    *,
    load: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> DryRun:
    """Plan ``spec`` for ``world`` workers (default: the mesh's size for a load, else the
    spec's workers) and say what each would do. Reads the source's index only."""
    conv = Conversion(spec, storage_options=storage_options)
    if load:
        if spec.format != Format.NATIVE or not spec.mesh:
            raise UsageError("a load dry run needs --mesh (and no --format hf): the layouts loaded")
        size = math.prod(spec.mesh.values())
        if world is not None and world != size:
            raise UsageError(
                f"a load on mesh {spec.mesh} runs on {size} ranks, not --world {world}"
            )
        world = size
    world = world or spec.workers
    if not 1 <= world <= MAX_DRY_RUN_WORLD:
        raise UsageError(f"world must be between 1 and {MAX_DRY_RUN_WORLD}, got {world}")
    started = time.perf_counter()
    conv.open_source()
    if load:
        budget = spec.budget("load")
        wanted = {
            name: [
                Held(box=it.box, holders=it.holders)
                for it in conv.layouts[name].write_items(meta.shape, meta.itemsize)
            ]
            for name, meta in conv.index.tensors.items()
        }
        plan = choose_plan(
            conv.index, wanted, world, budget, str(spec.strategy), StorageCost.of(conv.storage)
        )
    else:
        budget = conv.budget
        _, plan, _, _ = conv.plan(world)
    return _report("load" if load else "convert", spec.source, plan, budget.total, started)


def _report(mode: str, source: str, plan: ReadPlan, budget: int, started: float) -> DryRun:
    return DryRun(
        mode=mode,
        source=source,
        world=plan.world,
        strategy=plan.strategy,
        tensors=plan.tensor_count,
        bytes_total=plan.bytes_total,
        budget=budget,
        waves=len(plan.waves),
        storage_requests=plan.reads_count(),
        read=Spread.of(plan.bytes_read()),
        sent=Spread.of(plan.bytes_sent()),
        received=Spread.of(plan.bytes_received()),
        peak_memory=Spread.of(plan.peak_use()),
        plan_s=round(time.perf_counter() - started, 3),
        per_worker={
            "read": plan.bytes_read(),
            "sent": plan.bytes_sent(),
            "received": plan.bytes_received(),
        }
        if plan.world <= PER_WORKER_MAX
        else {},
    )
