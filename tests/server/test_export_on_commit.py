"""A training job's CheckpointManager exports every other committed step through a real
reshard-server (one job per step, keyed by the step's URI), never waiting for it."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from reshard_client import ExportOnCommit
from reshard_svc import CheckpointManager


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def test_every_other_step_is_exported_once_and_held_until_its_export_ends(server, tmp_path):
    data = tmp_path / "data"
    hook = ExportOnCommit(str(data / "hf-{step}"), every=2, spec={"format": "hf"},
                          client=server.client())  # fmt: skip
    with CheckpointManager(str(data / "run"), keep_last=1, on_commit=hook) as mgr:
        for step in range(1, 7):
            mgr.save(step, state(step))
        mgr.wait()
        hook(6, mgr._step_uri(6))  # a repeated submission is the same job (idempotency key)
    assert sorted(hook.jobs) == [2, 4, 6]
    client = server.client()
    for step, job_id in sorted(hook.jobs.items()):
        job = client.wait(job_id, timeout=240)
        assert job.state.value == "succeeded", (step, job.error)
        got = load_file(str(data / f"hf-{step}" / "model-00001-of-00001.safetensors"))
        assert got.keys() == {"w", "b"}
        assert all(torch.equal(got[k], v) for k, v in state(step).items()), step
    assert client.list().total == 3  # one job per exported step, the repeat included
    assert not (data / "hf-1").exists() and not (data / "hf-3").exists()


def test_an_unreachable_server_is_a_warning_not_a_training_failure(tmp_path, caplog):
    hook = ExportOnCommit(str(tmp_path / "hf-{step}"), url="http://127.0.0.1:9", token="t")
    with CheckpointManager(str(tmp_path / "run"), on_commit=hook) as mgr:
        for step in range(1, 3):
            mgr.save(step, state(step))
        mgr.wait()
        assert mgr.steps() == [1, 2]
    assert "was not submitted" in caplog.text
