"""Where a convert worker's exchange runs (``--device``): under ``auto``, NCCL only when
every worker on the node gets a GPU of its own, otherwise gloo on the CPU, with the reason
when GPUs were there; ``cpu`` always gloo; ``cuda`` on too few GPUs a typed error naming
the counts."""

from __future__ import annotations

import pytest

from reshard_svc.errors import UsageError
from reshard_svc.worker import exchange_backend


@pytest.mark.parametrize(
    "gpus, workers, backend, why",
    [
        (0, 1, "gloo", ""),
        (0, 4, "gloo", ""),
        (1, 1, "nccl", ""),
        (8, 4, "nccl", ""),
        (4, 4, "nccl", ""),
        (1, 2, "gloo", "2 workers on this node but 1 GPU(s)"),
        (2, 3, "gloo", "3 workers on this node but 2 GPU(s)"),
    ],
)
def test_a_worker_only_takes_a_gpu_that_exists(gpus, workers, backend, why):
    got, reason = exchange_backend(gpus, workers)
    assert got == backend
    assert reason.startswith(why) and (why == "") == (reason == "")


@pytest.mark.parametrize("gpus, workers", [(0, 1), (8, 4), (1, 2)])
def test_device_cpu_always_exchanges_on_the_cpu(gpus, workers):
    assert exchange_backend(gpus, workers, "cpu") == ("gloo", "")


@pytest.mark.parametrize("gpus, workers", [(1, 1), (8, 8)])
def test_device_cuda_takes_the_gpus_when_each_worker_has_one(gpus, workers):
    assert exchange_backend(gpus, workers, "cuda") == ("nccl", "")


@pytest.mark.parametrize("gpus, workers", [(0, 1), (1, 2), (3, 4)])
def test_device_cuda_on_too_few_gpus_names_the_counts(gpus, workers):
    with pytest.raises(UsageError, match=rf"{workers} worker\(s\) on this node but {gpus} GPU"):
        exchange_backend(gpus, workers, "cuda")
