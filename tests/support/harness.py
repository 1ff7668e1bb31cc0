"""Launch real torchrun-style worker processes (torch's elastic agent) on gloo.

``run(fn, world_size, *args)`` starts ``world_size`` processes with the same env torchrun
gives (RANK, WORLD_SIZE, MASTER_ADDR, ...), initialises a gloo process group in each, calls
``fn(*args)`` and returns ``{rank: return value}``. ``fn`` must be a module-level function.
"""

from __future__ import annotations

import atexit
import os
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from reshard_svc._process import free_port

__all__ = ["free_port", "run"]


def _entry(fn: Callable[..., Any], *args: Any) -> Any:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    try:
        result = fn(*args)
        dist.barrier()  # every rank has its verdict
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo sometimes aborts while the interpreter tears down after sub-mesh
    # work (with torch DCP as often as with us). The verdict is in and is returned before
    # the interpreter exits; then leave without the teardown.
    atexit.register(os._exit, 0)
    return result


def run(fn: Callable[..., Any], world_size: int, *args: Any) -> dict[int, Any]:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=0,
        monitor_interval=0.05,
        start_method="spawn",
    )
    return elastic_launch(config, _entry)(fn, *args)
