"""Every host path on CUDA tensors, one GPU, world size 1: save and load at 1, 2 and 7 I/O
threads (bf16, fp32, FP8 where torch has it), async_save staged in pinned buffers, the
manager's two tiers, overlap mode and its torn-snapshot guard, and convert with more
workers than GPUs. Bitwise throughout (compared as integers)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import reshard_svc
from reshard_svc import CheckpointManager, FastTier
from tests.support.cli import reshard

DEV = "cuda"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = {
        "bf16": torch.randn(1024, 1536, device=DEV, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(3, 1000, 77, device=DEV, generator=g),
        "strided": torch.randn(512, 300, device=DEV, generator=g)[:, ::3],
        "scalar": torch.tensor(7.0, device=DEV),
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["fp8"] = torch.randn(256, 256, device=DEV, generator=g).to(torch.float8_e4m3fn)
    return out


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_save_and_load_cuda_state_bitwise(tmp_path, monkeypatch, threads):
    """The big tensors come back through the pinned ring (read and checked in a slot, then
    copied to the device on a side stream), the small ones mapped and copied."""
    from reshard_svc.runtime.reading import StorageSource

    runs = []
    real = StorageSource._read_to_device
    monkeypatch.setattr(
        StorageSource, "_read_to_device", lambda self, *a: runs.append(a[2:]) or real(self, *a)
    )
    state = _state(threads)
    root = str(tmp_path / "ckpt")
    reshard_svc.save(state, root, io_threads=threads)
    assert reshard_svc.verify(root).ok
    back = {k: torch.empty_like(v) for k, v in state.items()}
    reshard_svc.load(back, root, io_threads=threads)
    for k, v in state.items():
        assert back[k].device.type == "cuda" and _same(back[k], v), k
    assert runs, "no read came back through the ring"


def test_async_save_stages_cuda_state_in_pinned_buffers(tmp_path):
    from reshard_svc.runtime.async_save import AsyncSaver

    state = _state(1)
    want = {k: v.clone() for k, v in state.items()}
    saver = AsyncSaver()
    try:
        future = saver.save(state, str(tmp_path / "a"))
        for v in state.values():
            v.add_(1) if v.dtype != torch.float8_e4m3fn else v.zero_()  # training goes on
        future.result()
        staged = list(saver._stager._set.buffers.values())
        assert staged and all(b.is_pinned() for b in staged)
    finally:
        saver.close()
    back = {k: torch.empty_like(v) for k, v in want.items()}
    reshard_svc.load(back, str(tmp_path / "a"))
    assert all(_same(back[k], v) for k, v in want.items())


def test_manager_with_a_fast_tier_resumes_cuda_state_from_either_tier(tmp_path):
    state = _state(2)
    root, fast = str(tmp_path / "root"), FastTier(str(tmp_path / "fast"), every=1)
    with CheckpointManager(root, interval=2, fast=fast) as mgr:
        for step in range(1, 4):
            state["fp32"].add_(1)
            mgr.save(step, {"m": state})
        mgr.wait()
        assert mgr.steps() == [2] and mgr.fast_steps() == [2, 3]
    got = {"m": {k: torch.empty_like(v) for k, v in state.items()}}
    with CheckpointManager(root, fast=fast) as mgr:
        assert mgr.load(got) == 3 and mgr.last_restore.tier == "fast"
    assert all(_same(got["m"][k], v) for k, v in state.items())


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    ).to(DEV)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_overlap_mode_commits_what_the_job_held_at_each_save(tmp_path):
    model, opt = _model()
    held = {}
    with CheckpointManager(str(tmp_path / "root"), optimizers=[opt]) as mgr:
        for step in range(1, 5):
            model(torch.randn(64, 256, device=DEV)).square().mean().backward()
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            held[step] = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save(step, sd)
            opt.step()  # the hook waits for the side stream's copies first
            opt.zero_grad()
        mgr.wait()
        assert mgr.steps() == [1, 2, 3, 4]
    for step, want in held.items():
        got = {"model": {k: torch.empty_like(v) for k, v in want.items()}}
        with CheckpointManager(str(tmp_path / "root")) as mgr:
            mgr.load(got, step=step, strict=False)
        assert all(_same(got["model"][k], v) for k, v in want.items()), step


def test_a_cuda_tensor_changed_before_its_copy_finished_makes_the_step_not_count(tmp_path, caplog):
    model, opt = _model()
    root = str(tmp_path / "root")
    with caplog.at_level(logging.WARNING, logger="reshard_svc"):
        with CheckpointManager(root, optimizers=[opt]) as mgr:
            mgr.save(1, {"model": model.state_dict()})
            opt.step()
            mgr.wait()
            torch.cuda._sleep(2_000_000_000)  # the side stream's copies wait behind this
            mgr.save(2, {"model": model.state_dict()})
            with torch.no_grad():
                model[0].weight.add_(1.0)  # in place, without waiting for the copies
            mgr.wait()
            assert mgr.steps() == [1]
    assert any(
        "0.weight" in r.getMessage() and "does not count" in r.getMessage() for r in caplog.records
    )


def test_convert_with_more_workers_than_gpus(tmp_path):
    src = str(tmp_path / "src")
    reshard_svc.save({k: v.cpu() for k, v in _state(3).items()}, src)
    gpus = torch.cuda.device_count()
    dst = str(tmp_path / "dst")
    r = reshard("convert", src, dst, "--mesh", "tp=2", "--workers", str(gpus + 1), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["event"] == "done"
    assert "one GPU each is needed" in r.stderr  # gloo on the CPU, saying why
    assert reshard_svc.verify(dst).ok
    r = reshard(
        "convert",
        src,
        str(tmp_path / "no"),
        "--mesh",
        "tp=2",
        "--workers",
        str(gpus + 1),
        "--device",
        "cuda",
    )
    assert r.returncode == 2 and f"but {gpus} GPU(s)" in r.stderr, r.stderr


def test_a_sync_save_moves_device_bands_through_one_pinned_ring(tmp_path):
    """The ring is allocated once (pinned) and reused: the same slots after five saves,
    every slot free between saves, each save bitwise."""
    from reshard_svc.runtime.ring import pinned_ring

    state = _state(4)
    reshard_svc.save(state, str(tmp_path / "0"))
    ring = pinned_ring()
    slots = [s.buf.data_ptr() for s in ring.slots]
    assert ring.pinned and all(s.buf.is_pinned() for s in ring.slots)
    for i in range(1, 5):
        reshard_svc.save(state, str(tmp_path / str(i)))
        assert all(s.free.is_set() for s in ring.slots)
    assert [s.buf.data_ptr() for s in pinned_ring().slots] == slots
    back = {k: torch.empty_like(v) for k, v in state.items()}
    reshard_svc.load(back, str(tmp_path / "4"))
    assert all(_same(back[k], v) for k, v in state.items())


def test_a_bad_block_loaded_into_cuda_tensors_is_named_and_frees_the_ring(tmp_path):
    import os

    from reshard_svc.runtime.ring import pinned_ring

    state = {"w": torch.randn(4096, 1024, device=DEV)}  # 16 MiB: two slots and more
    root = str(tmp_path / "ckpt")
    reshard_svc.save(state, root)
    (name,) = [f for f in os.listdir(root) if f.endswith(".safetensors")]
    with open(os.path.join(root, name), "r+b") as f:
        f.seek(9 * (1 << 20) + 5)
        byte = f.read(1)
        f.seek(9 * (1 << 20) + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    back = {"w": torch.zeros_like(state["w"])}
    with pytest.raises(reshard_svc.ChecksumError, match=r"\(block 9\) fail"):
        reshard_svc.load(back, root, io_threads=4)
    assert all(s.free.is_set() for s in pinned_ring().slots)
