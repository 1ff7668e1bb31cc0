"""reshard_svc as torch DCP's storage backend: ``dcp.save`` / ``dcp.async_save`` /
``dcp.load`` with FSDP2 × TP and AdamW state through our writer and reader, real gloo
processes; the result read by ``reshard_svc.load`` too, and other sources through the
reader."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import reshard_svc
from reshard_svc.dcp import Reader, Writer
from reshard_svc.errors import ChecksumError
from tests.support import dcp_jobs as jobs
from tests.support.harness import run

pytestmark = [pytest.mark.distributed]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dcp_save_through_our_writer_loads_anywhere_bitwise(tmp_path, mode):
    uri, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref.safetensors")
    run(jobs.save_through_writer, 4, uri, ref, mode)
    assert reshard_svc.verify(uri).ok  # our format: every block's CRC32C
    assert "reshard_svc" in reshard_svc.inspect(uri).created_by
    # DCP's planner at TP=2 on 2 ranks, and ours at FSDP on 3
    assert run(jobs.load_through_reader, 2, uri, ref, 2, 1, "dcp") == {0: [], 1: []}
    assert run(jobs.load_through_reader, 3, uri, ref, 1, 3, "ours") == {r: [] for r in range(3)}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)},
        "step": seed,
    }


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(32, 16), "b": torch.zeros(16)}, "step": -1}


@pytest.mark.parametrize("source", ["ours", "dcp", "hf"])
def test_the_reader_reads_every_source(tmp_path, source):
    from safetensors.torch import save_file

    want, uri = _state(3), str(tmp_path / source)
    if source == "ours":
        reshard_svc.save(want, uri)
    elif source == "dcp":
        dcp.save(want, checkpoint_id=uri, no_dist=True)
    else:
        os.makedirs(uri)
        save_file({f"model.{k}": v for k, v in want["model"].items()}, f"{uri}/model.safetensors")
    got = _zeros()
    if source == "hf":
        got.pop("step")  # an HF folder holds tensors only
    dcp.load(got, storage_reader=Reader(uri), no_dist=True)
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    assert source == "hf" or got["step"] == 3


def test_a_flipped_bit_fails_dcp_load_with_our_checksum_error(tmp_path):
    uri = str(tmp_path / "ckpt")
    dcp.save(_state(1), storage_writer=Writer(uri), no_dist=True)
    data = sorted(n for n in os.listdir(uri) if n.endswith(".safetensors"))[0]
    with open(os.path.join(uri, data), "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as e:  # DCP wraps each rank's failure
        dcp.load(_zeros(), storage_reader=Reader(uri), no_dist=True)
    assert ChecksumError.__name__ in str(e.value) and "fail their CRC32C" in str(e.value)


def test_a_writer_killed_before_finish_commits_nothing_and_gc_collects(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    uri = tmp_path / "ckpt"
    with pytest.raises(ChildFailedError):
        run(jobs.killed_before_finish, 2, str(uri))
    assert not (uri / "reshard.index.json").exists()
    left = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert left, "the killed save left nothing to collect"  # its staging and its lease
    report = reshard_svc.format.collect.collect(str(uri))
    assert report.removed
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["ckpt"])


def test_the_bridge_pages_dcp_switch_runs(tmp_path):
    from tests.support.docs import block

    code = block("dcp-backend", "python").replace("/tmp/ckpt-dcp", str(tmp_path / "ckpt"))
    scope: dict = {}
    exec(compile(code, "docs/bridge.md:dcp-backend", "exec"), scope)
    assert reshard_svc.verify(str(tmp_path / "ckpt")).ok
    assert scope["state"]["step"] == 100


@pytest.mark.slow
def test_torchtnt_saves_and_resumes_through_our_writer_and_reader(tmp_path):
    """A framework whose DCP checkpointer takes a storage writer and reader: torchtnt's own
    ``train`` and ``DistributedCheckpointSaver`` (async, with its retention) at FSDP 2 × TP 2
    write our format; a fresh job at TP 2 resumes with its ``restore_from_latest``, bitwise
    against what the job held at the end."""
    root, ref = tmp_path / "run", str(tmp_path / "ref.safetensors")
    run(jobs.torchtnt_train, 4, str(root), ref, 4)
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("epoch_"))
    assert len(kept) == 2, kept  # torchtnt's keep_last_n_checkpoints pruned the step-2 one
    for name in kept:
        assert reshard_svc.verify(str(root / name)).ok
        assert "app_state.model.output.weight" in reshard_svc.inspect(str(root / name)).tensors
    got = run(jobs.torchtnt_resume, 2, str(root), ref)
    assert got == {r: {"restored": True, "differ": [], "step": 4} for r in range(2)}
