"""``python -m reshard_svc.worker``: the torchrun entry point (see
:mod:`reshard_svc.jobs.worker`), kept at this name for launch scripts and TrainJobs."""

from reshard_svc.jobs.worker import process_main

if __name__ == "__main__":
    process_main()
