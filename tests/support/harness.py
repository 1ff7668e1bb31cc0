"""Launch real torchrun-style worker processes (torch's elastic agent) on gloo.

``run(fn, world_size, *args)`` starts ``world_size`` processes with the same env torchrun
gives (RANK, WORLD_SIZE, MASTER_ADDR, ...), initialises a gloo process group in each, calls
``fn(*args)`` and returns ``{rank: return value}``. ``fn`` must be a module-level function.

The workers come from one forkserver per test session that has imported torch and
reshard_svc once (``_PRELOAD``): a spawned worker spent ~3.5 s of CPU importing torch, the
suite's largest repeated cost. Each worker is still a fresh process of its own (forked from
that single-threaded server, never from pytest) and runs with the environment of the test
that launched it, in its working directory, as a spawned one would (:func:`_entry` restores
both). The kill tests start their jobs from the same server (:data:`JOBS`); such a job
forks its own workers, so they are its children.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.launcher.api import elastic_launch

from bench.common import AGENT_KEYS, TORCH_PRELOAD, loopback_launch_config
from reshard_svc._process import free_port

__all__ = ["JOBS", "free_port", "job_processes", "run", "start_forkserver", "wait_dead"]

#: Imported once by the forkserver, before it forks any worker. Nothing that imports
#: fsspec: it reads its configuration (a test's ``FSSPEC_S3``) from the environment when
#: first imported, and the forkserver's is the session's, not the test's.
_PRELOAD = [
    *TORCH_PRELOAD,
    "reshard_svc",
    "reshard_svc.sessions",
    "reshard_client.cli",
    "tests.support.harness",
    "tests.support.cli",  # the CLI's commands run in processes forked from here too
]
multiprocessing.set_forkserver_preload(_PRELOAD)

#: Where a test starts a whole job (a process that calls :func:`run`, to be killed).
JOBS = multiprocessing.get_context("forkserver")


def start_forkserver() -> None:
    """Start the forkserver now (the session's start): it keeps the environment it started
    with, so it must not start inside a test that changed it."""
    from multiprocessing import forkserver

    forkserver.ensure_running()


#: The variables torch's elastic agent sets for each worker (the rest is the launcher's env).
_LAUNCHER_KEYS = AGENT_KEYS | {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def _launcher_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in _LAUNCHER_KEYS or k.startswith("TORCHELASTIC_")}


def _entry(test_env: dict[str, str], cwd: str, fn: Callable[..., Any], *args: Any) -> Any:
    # A forked worker holds the forkserver's environment and directory: give it the test's,
    # as spawn did, with the agent's per-worker variables on top.
    own = _launcher_env(dict(os.environ))
    os.environ.clear()
    os.environ.update(test_env)
    os.environ.update(own)
    os.chdir(cwd)
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
    # A whole job a test kills (started from JOBS) forks its workers itself: it is already
    # a preloaded, fresh process, and a forkserver of its own would import torch again
    # (~4 s a launch). Its workers are then its children (see :func:`job_processes`).
    in_job = multiprocessing.parent_process() is not None
    config = loopback_launch_config(world_size, "fork" if in_job else "forkserver")
    test_env = {k: v for k, v in os.environ.items() if k not in _launcher_env(dict(os.environ))}
    return elastic_launch(config, _entry)(test_env, os.getcwd(), fn, *args)


def job_processes(launcher_pid: int) -> list[Any]:
    """Every process of the job that process ``launcher_pid`` (started from :data:`JOBS`)
    started with :func:`run`: its workers, which it forked, and whatever they forked
    (background writers), as Slurm's signal reaches a step's tasks. Not the agent."""
    import psutil

    return psutil.Process(launcher_pid).children(recursive=True)


def wait_dead(procs: list[Any], timeout: float = 30) -> None:
    """Wait until each process is gone or a zombie: a killed job's workers are orphans, and
    whoever adopts them may take a second to reap them; a zombie holds nothing and writes
    nothing, so it counts as dead."""
    import psutil

    deadline = time.monotonic() + timeout
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.01)
        else:
            raise TimeoutError(f"process {p.pid} still runs {timeout:.0f} s after its kill")
