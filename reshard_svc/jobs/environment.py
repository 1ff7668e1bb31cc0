"""A worker's environment, spelled once: the variable names the control plane, the CLI's
runner and the worker agree on, and the one function that builds them.

Every launcher (local, Slurm, Kubernetes) and the ``reshard`` CLI hand a worker
:func:`worker_env`; the worker, the event reporter and the storage leases read these
names and no others.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "CALLBACK_TIMEOUT_ENV",
    "CALLBACK_TOKEN_ENV",
    "CALLBACK_URL_ENV",
    "DEBUG_BUFFERS_ENV",
    "DIE_WITH_PARENT_ENV",
    "JOB_ENV",
    "LAUNCH_ENV",
    "PARENT_ENV",
    "WORKER_NAMES",
    "NODE_RANK_ENV",
    "lease_owner",
    "node_rank",
    "worker_env",
]

#: The server's job id: a worker of a job dies with its launcher and reports under it.
JOB_ENV = "RESHARD_JOB_ID"
#: One attempt of a job (job, attempt, a random part): what recovery may stop.
LAUNCH_ENV = "RESHARD_LAUNCH_ID"
#: Where rank 0 POSTs its progress events, with the token minted for this job alone.
CALLBACK_URL_ENV = "RESHARD_CALLBACK_URL"
CALLBACK_TOKEN_ENV = "RESHARD_CALLBACK_TOKEN"
CALLBACK_TIMEOUT_ENV = "RESHARD_CALLBACK_TIMEOUT_S"
#: The CLI's own workers: die with the ``reshard`` process whose pid is given.
DIE_WITH_PARENT_ENV = "RESHARD_DIE_WITH_PARENT"
PARENT_ENV = "RESHARD_PARENT_PID"
#: ``1``: every buffer we release is poisoned and checked when taken again (a use after
#: release becomes an error naming the buffer; :mod:`reshard_svc.runtime.buffers`).
DEBUG_BUFFERS_ENV = "RESHARD_DEBUG_BUFFERS"
#: The names a remote engine must pass on to each worker (a TrainJob's env list).
WORKER_NAMES = (JOB_ENV, CALLBACK_URL_ENV, CALLBACK_TOKEN_ENV)


def worker_env(
    base: Mapping[str, str] | None = None,
    *,
    job_id: str | None = None,
    launch_id: str | None = None,
    callback_url: str | None = None,
    callback_token: str | None = None,
    parent_pid: int | None = None,
) -> dict[str, str]:
    """``base`` (the operator's environment) with a worker's own variables set: the job
    and its launch, the event callback, or (``parent_pid``) the CLI it dies
    with. Always unbuffered output; one OpenMP thread unless ``base`` says otherwise."""
    env = dict(base or {})
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if job_id is not None:
        env[JOB_ENV] = job_id
    if launch_id is not None:
        env[LAUNCH_ENV] = launch_id
    if callback_url is not None:
        env[CALLBACK_URL_ENV] = callback_url
    if callback_token is not None:
        env[CALLBACK_TOKEN_ENV] = callback_token
    if parent_pid is not None:
        env[DIE_WITH_PARENT_ENV] = "1"
        env[PARENT_ENV] = str(parent_pid)
    return env


#: torchrun's: the rank of this worker's node (its agent) among the job's nodes.
NODE_RANK_ENV = "GROUP_RANK"


def node_rank() -> str | None:
    """This worker's node as torchrun numbers it, or None outside torchrun."""
    return os.environ.get(NODE_RANK_ENV)


def lease_owner(job_id: str) -> str:
    """The owner of record of a job's target leases, which the server may declare over
    once the job's workers are gone."""
    return f"reshard-job-{job_id}"
