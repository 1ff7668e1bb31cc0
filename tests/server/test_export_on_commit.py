"""A training job's CheckpointManager exports every other committed step through a real
reshard-server (one job per step, keyed by the step's URI), never waiting for it."""

from __future__ import annotations

import pytest
import torch

from reshard_client import ExportOnCommit
from reshard_svc import CheckpointManager

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama: its config (for the export folders) and its weights."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


def state(step: int, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    if weights is not None:  # the model "after step ``step``"
        return {k: v + step for k, v in weights.items()}
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def test_every_other_step_is_exported_once_and_held_until_its_export_ends(server, tmp_path, llama):
    config, weights = llama
    data = tmp_path / "data"
    for step in (2, 4, 6):  # model folders waiting for their weights (config, tokenizer)
        config.save_pretrained(data / f"hf-{step}")
    hook = ExportOnCommit(
        str(data / "hf-{step}"), every=2, spec={"format": "hf"}, client=server.client()
    )
    with CheckpointManager(str(data / "run"), keep_last=1, on_commit=hook) as mgr:
        for step in range(1, 7):
            mgr.save(step, state(step, weights))
        mgr.wait()
        hook(6, mgr._step_uri(6))  # a repeated submission is the same job (idempotency key)
    assert sorted(hook.jobs) == [2, 4, 6]
    client = server.client()
    for step, job_id in sorted(hook.jobs.items()):
        job = client.wait(job_id, timeout=240)
        assert job.state.value == "succeeded", (step, job.error)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(data / f"hf-{step}"))
        got = {k: v.detach() for k, v in model.state_dict().items()}
        want = state(step, weights)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), step
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


def test_an_ended_export_is_no_longer_held_and_stays_in_jobs():
    """``jobs`` records every export submitted; ``holds`` only those still running (an
    export that ended early used to vanish from ``jobs``)."""
    from types import SimpleNamespace

    class Jobs:  # the two calls the hook makes, answering from a dict
        def __init__(self) -> None:
            self.states: dict[str, str] = {}

        def submit(self, body, idempotency_key):
            job_id = f"job-{len(self.states)}"
            self.states[job_id] = "running"
            return SimpleNamespace(id=job_id)

        def get(self, job_id):
            return SimpleNamespace(state=SimpleNamespace(value=self.states[job_id]))

    jobs = Jobs()
    hook = ExportOnCommit("/exports/step-{step}", client=jobs)  # type: ignore[arg-type]
    hook(1, "run/step-1")
    hook(2, "run/step-2")
    assert hook.holds() == {1, 2}
    jobs.states["job-0"] = "succeeded"
    assert hook.holds() == {2}
    assert hook.jobs == {1: "job-0", 2: "job-1"}
