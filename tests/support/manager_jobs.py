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


def _full(tree: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        full = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
        out[prefix] = full.detach().clone().contiguous()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            _full(v, f"{prefix}.{k}", out)


def _state(model: Any, optim: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def full_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a model/optimizer state dict, whole (collective for DTensors)."""
    out: dict[str, torch.Tensor] = {}
    _full(state["model"], "model", out)
    _full(state["optim"]["state"], "optim.state", out)
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
