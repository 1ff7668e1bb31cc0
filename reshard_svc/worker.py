"""The worker: ``torchrun ... -m reshard_svc.worker convert SRC DST [options]``.

Every worker runs :func:`reshard_svc.convert`; the backend is NCCL when CUDA is available
and gloo otherwise (same code path). Any launch torchrun supports works: ``--standalone``
on one host, ``--nnodes N --rdzv-backend c10d`` under ``srun``, or a Kubeflow TrainJob
(``PET_*`` variables). The command line is :class:`reshard_svc.jobs.spec.ConvertSpec`'s.

Rank 0 reports ``progress`` events after every wave, then ``done`` or ``error``: as JSON
lines to ``--progress-file`` and/or POSTed to ``RESHARD_CALLBACK_URL`` (see
:mod:`reshard_svc.jobs.events`). The exit code is 0 only after the target is committed; 2 for
a bad option. SIGTERM (what torchrun, ``scancel`` and Kubernetes send) ends a worker before
any commit.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any, NoReturn

from reshard_svc._collector import collector_paused
from reshard_svc._process import set_pdeathsig
from reshard_svc.errors import UsageError
from reshard_svc.jobs.argv import build_parser, from_args
from reshard_svc.jobs.environment import DIE_WITH_PARENT_ENV, JOB_ENV, PARENT_ENV, lease_owner
from reshard_svc.jobs.events import EventReporter, done_event
from reshard_svc.jobs.spec import ConvertSpec
from reshard_svc.storage import leases

__all__ = ["build_parser", "main", "process_main"]

logger = logging.getLogger("reshard_svc.worker")


def _die_with_parent() -> None:
    """Exit when our launcher (torchrun, or the ``reshard`` CLI) dies: no orphans, no late
    commit.

    ``PR_SET_PDEATHSIG`` only covers a parent that dies *after* the call, and this process
    ran for a while (starting Python) before it; so a parent that is no longer the
    launcher (we were re-parented) means it already died, and we exit now.
    """
    if not set_pdeathsig(signal.SIGKILL):
        return
    expected = os.environ.get(PARENT_ENV)
    if expected:
        gone = str(os.getppid()) != expected
    else:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent = f.read()
        except OSError:
            parent = b""
        gone = b"torch.distributed.run" not in parent and b"torchrun" not in parent
    if gone:
        logger.error("our launcher is gone (our parent is now %d); exiting", os.getppid())
        os._exit(1)


class Interrupted(KeyboardInterrupt):
    """SIGTERM (what torchrun, ``scancel``, Kubernetes and a terminal's process group
    send): raised like Ctrl-C's KeyboardInterrupt, so the run aborts cleanly — its staging
    data and lease go — before the process ends."""


def _stop_on_sigterm() -> None:
    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one kills at once
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    # Every line names its rank; ranks other than 0 only speak up on errors (each rank
    # plans the same thing, so their info and warnings would repeat rank 0's).
    level = os.environ.get("LOGLEVEL", "INFO") if rank == 0 else "ERROR"
    logging.basicConfig(
        level=level, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    job = os.environ.get(JOB_ENV)
    if job:
        leases.set_owner(lease_owner(job))  # the server may declare over its leases
    if job or os.environ.get(DIE_WITH_PARENT_ENV):
        _die_with_parent()
    _stop_on_sigterm()
    reporter = EventReporter.from_env(args.progress_file) if rank == 0 else EventReporter()
    try:
        spec = from_args(args)
    except UsageError as e:
        reporter.send({"event": "error", "error": f"UsageError: {e}"})
        reporter.close()
        logger.error("rank %d: %s", rank, e)
        return 2
    code = run(spec, reporter)
    reporter.close()
    return code


def exchange_backend(gpus: int, local_workers: int, device: str = "auto") -> tuple[str, str]:
    """Where a worker's exchange runs (``device``: ``auto``, ``cpu`` or ``cuda``):
    ``("nccl", "")`` when every worker on this node gets a GPU of its own, else
    ``("gloo", why)``; ``cuda`` on too few GPUs is a :class:`UsageError` naming the counts.
    A worker never sets a device that does not exist (two workers on a one-GPU host would
    ask for ``cuda:1``)."""
    enough = gpus >= local_workers >= 1
    if device == "cpu":
        return "gloo", ""
    if device == "cuda" and not enough:
        raise UsageError(
            f"--device cuda: {local_workers} worker(s) on this node but {gpus} GPU(s); each "
            "worker needs its own (pass fewer workers, or --device auto or cpu)"
        )
    if enough:
        return "nccl", ""
    if gpus == 0:
        return "gloo", ""
    return "gloo", f"{local_workers} workers on this node but {gpus} GPU(s): one GPU each is needed"


def run(spec: ConvertSpec, reporter: EventReporter) -> int:
    """Join the process group (NCCL with GPUs, else gloo), convert, report; 0 once committed."""
    # What is imported here (torch: hundreds of thousands of objects) lives until exit.
    # Collecting during the import is wasted work, and afterwards the collector should not
    # walk it again in every full collection: import with collection off, then freeze.
    with collector_paused(freeze=True):
        import torch
        import torch.distributed as dist

        from reshard_svc.runtime.convert import Conversion

    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) >= 1
    if distributed and not dist.is_initialized():
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        try:
            backend, why = exchange_backend(gpus, local, str(spec.device))
        except UsageError as e:
            reporter.send({"event": "error", "error": f"UsageError: {e}"})
            logger.error("rank %s: %s", os.environ.get("RANK", "0"), e)
            return 2
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        elif why and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            logger.warning("exchange on the CPU (gloo): %s", why)
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    started = time.time()

    def progress(info: Any) -> None:
        reporter.send({"event": "progress", **info.to_json()})

    try:
        with collector_paused():
            result = Conversion(spec).run(progress)
    except Exception as e:
        reporter.send({"event": "error", "error": f"{type(e).__name__}: {e}"})
        logger.error("rank %d: convert failed: %s: %s", rank, type(e).__name__, e)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the run aborted (nothing committed)
        reporter.send({"event": "error", "error": "Interrupted: nothing was committed"})
        return 130
    reporter.send(done_event(result, time.time() - started))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def process_main() -> NoReturn:
    """``python -m reshard_svc.worker``: run :func:`main` and leave with its code.

    torch 2.13's gloo sometimes aborts while the interpreter tears down after sub-mesh
    work, which would turn a committed run into a failed one (torchrun and the engines
    judge a job by its exit code). The process group is already destroyed and every
    report sent, so the process exits at once with the run's own code.
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    process_main()
