"""Training jobs that checkpoint with ``reshard_svc.CheckpointManager``, run on gloo workers
(spawned: module-level functions)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tests.support import training
from tests.support.foreign_writers import flatten_full


def _state(model: Any, optim: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def full_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a model/optimizer state dict, whole (collective for DTensors)."""
    out: dict[str, torch.Tensor] = {}
    flatten_full(state["model"], "model", out)
    flatten_full(state["optim"]["state"], "optim.state", out)
    return out


def train_and_checkpoint(root: str, ref: str, steps: int, tp: int, dp: int, policy: dict) -> list:
    """FSDP × TP training, ``mgr.save`` every step; rank 0 writes the final full state to
    ``ref``. Returns the manager's committed steps."""
    from reshard_svc import CheckpointManager

    model, optim, dp_mesh = training.build(tp, dp)
    with CheckpointManager(root, **policy) as mgr:
        for step in range(1, steps + 1):
            training.train(model, optim, range(step, step + 1), dp_mesh)
            mgr.save(step, {**_state(model, optim), "data": {"next_batch": step + 1}})
        mgr.wait()
        committed = mgr.steps()
    full = full_state(_state(model, optim))
    if dist.get_rank() == 0:
        save_file(full, ref)
    return committed


def resume_and_compare(root: str, ref: str, tp: int, dp: int) -> tuple[int | None, list[str]]:
    """Another world and layout: ``mgr.load`` of the newest step, compared bitwise with
    ``ref``; returns (step, names that differ)."""
    from reshard_svc import CheckpointManager

    model, optim, _ = training.build(tp, dp)
    training.train(model, optim, range(1))  # optimizer state to load into (any batch split)
    state = {**_state(model, optim), "data": {"next_batch": 0}}
    with CheckpointManager(root) as mgr:
        step = mgr.load(state)
    got = full_state(state)
    want = load_file(ref)
    bad = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
    if state["data"]["next_batch"] != (step or 0) + 1:
        bad.append("data.next_batch")
    return step, bad


def preemptible_loop(root: str, steps: int, ready: str) -> dict[str, Any]:
    """Saves every 5 steps, stops cleanly on SIGTERM: the final step is saved at the next
    step boundary by all ranks together. Touches ``ready`` after the first save."""
    from reshard_svc import CheckpointManager

    model, optim, dp_mesh = training.build(1, dist.get_world_size())
    last = 0
    with CheckpointManager(root, interval=5, save_on_signals=[signal.SIGTERM]) as mgr:
        start = (mgr.load(_state(model, optim)) or 0) + 1
        for step in range(start, start + steps):
            training.train(model, optim, range(step, step + 1), dp_mesh)
            mgr.save(step, _state(model, optim))
            last = step
            if step == start + 5 and dist.get_rank() == 0:
                open(ready, "w").close()
            if mgr.should_stop:
                break
            time.sleep(0.05)
        stopped = mgr.should_stop
    return {"start": start, "last": last, "stopped": stopped, "pid": os.getpid()}


def value_of(step: int, rank_count: int = 0) -> dict[str, Any]:
    """A state that is a function of its step (any reader can check it), sharded over the
    world as DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256) + step
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "meta": {"step": step}}


def save_forever(root: str, ready: str) -> None:
    """Save every step (keep the newest 2) until killed."""
    from reshard_svc import CheckpointManager

    with CheckpointManager(root, keep_last=2) as mgr:
        start = (mgr.latest() or 0) + 1
        for step in range(start, start + 100_000):
            mgr.save(step, value_of(step))
            if step == start + 1 and dist.get_rank() == 0:
                open(ready, "w").close()


def full_value_of(step: int) -> dict[str, Any]:
    """:func:`value_of` as one process holds it: whole tensors."""
    return {
        "w": torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256) + step,
        "meta": {"step": step},
    }


def resume_and_check_here(root: str) -> tuple[int | None, bool]:
    """In this one process (no process group): load the newest committed step of a job
    that saved on 2 ranks; is every byte what that step saved? Then save the next step,
    whose retention collects what the dead job left."""
    from reshard_svc import CheckpointManager

    state = full_value_of(-1)
    with CheckpointManager(root, keep_last=2, async_save=False) as mgr:
        step = mgr.load(state)
        if step is None:
            return None, True
        ok = torch.equal(state["w"], full_value_of(step)["w"]) and state["meta"]["step"] == step
        mgr.save(step + 1, full_value_of(step + 1), force=True)
    return step, ok
