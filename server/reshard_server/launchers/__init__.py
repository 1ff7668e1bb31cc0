"""Where a job's workers run: one module per engine on one contract
(:mod:`~reshard_server.launchers.base`). ``RESHARD_LAUNCHER`` picks one
(:func:`make_launcher`):

- ``local`` (default): ``torchrun --standalone`` subprocesses on this machine
  (:mod:`~reshard_server.launchers.local`).
- ``slurm``: ``sbatch`` / ``squeue`` / ``scancel`` (:mod:`~reshard_server.launchers.slurm`).
- ``kubernetes``: Kubeflow Trainer ``TrainJob`` objects
  (:mod:`~reshard_server.launchers.kubernetes`).
- ``ray``: Ray jobs on a Ray cluster (:mod:`~reshard_server.launchers.ray`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reshard_server.launchers.base import (
    ENGINE_STATES,
    JOB_ENV,
    EngineStatus,
    Handle,
    Launch,
    Launcher,
    LauncherError,
    job_pids,
    read_log,
    set_pdeathsig,
    tagged_pids,
)
from reshard_server.launchers.local import LocalLauncher

if TYPE_CHECKING:
    from reshard_server.config import Settings

__all__ = [
    "ENGINE_STATES",
    "JOB_ENV",
    "EngineStatus",
    "Handle",
    "Launch",
    "Launcher",
    "LauncherError",
    "LocalLauncher",
    "job_pids",
    "make_launcher",
    "read_log",
    "set_pdeathsig",
    "tagged_pids",
]


def make_launcher(settings: Settings) -> Launcher:
    """The engine ``settings.launcher`` names."""
    if settings.launcher == "slurm":
        from reshard_server.launchers.slurm import SlurmLauncher

        return SlurmLauncher(settings)
    if settings.launcher == "ray":
        from reshard_server.launchers.ray import RayLauncher

        return RayLauncher(settings)
    if settings.launcher == "kubernetes":
        from reshard_server.launchers.kubernetes import KubernetesLauncher

        return KubernetesLauncher(settings)
    return LocalLauncher(settings.worker_python or None)
