"""Where a convert worker's exchange runs: NCCL only when every worker on the node gets a
GPU of its own; otherwise gloo on the CPU, with the reason when GPUs were there."""

from __future__ import annotations

import pytest

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
