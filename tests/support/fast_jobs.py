"""Training jobs with a fast tier (``CheckpointManager(fast=FastTier(...))``), several
simulated nodes on one host: each rank is told its node and that node's own fast path.
Spawned gloo workers: module-level functions."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tests.support import training
from tests.support.manager_jobs import _state, full_state


def _tier(paths: list[str], nodes: list[int], every: int = 1, copies: int = 2) -> Any:
    from reshard_svc import FastTier

    node = nodes[dist.get_rank()]
    return FastTier(paths[node], every=every, copies=copies, node=node)


def train_with_fast_tier(
    root: str, refs: str, paths: list[str], nodes: list[int], steps: int, tp: int, dp: int
) -> dict[str, Any]:
    """FSDP × TP with AdamW, ``mgr.save`` every step (persistent every 4, fast every step,
    2 copies); rank 0 keeps what the job held after each step in ``refs/step-N``. Ends as a
    kill would: nothing closed, no lease released."""
    from reshard_svc import CheckpointManager

    model, optim, dp_mesh = training.build(tp, dp)
    mgr = CheckpointManager(root, interval=4, fast=_tier(paths, nodes))
    for step in range(1, steps + 1):
        training.train(model, optim, range(step, step + 1), dp_mesh)
        state = _state(model, optim)
        mgr.save(step, {**state, "data": {"next_batch": step + 1}})
        full = full_state(state)
        if dist.get_rank() == 0:
            save_file(full, os.path.join(refs, f"step-{step}.safetensors"))
    mgr.wait()
    return {"fast": mgr.fast_steps(), "persistent": mgr.steps()}


def resume_from_fast_tier(
    root: str, refs: str, paths: list[str], nodes: list[int], tp: int, dp: int
) -> dict[str, Any]:
    """Another world and layout: ``mgr.load``, compared bitwise with what the job held at
    the step it says it loaded."""
    from reshard_svc import CheckpointManager

    model, optim, _ = training.build(tp, dp)
    training.train(model, optim, range(1))  # optimizer state to load into
    state = {**_state(model, optim), "data": {"next_batch": 0}}
    with CheckpointManager(root, fast=_tier(paths, nodes)) as mgr:
        step = mgr.load(state)
        info = mgr.last_restore
    got = full_state(state)
    want = load_file(os.path.join(refs, f"step-{step}.safetensors"))
    bad = [k for k in want if k not in got or not _bitwise(got[k], want[k])]
    if state["data"]["next_batch"] != (step or 0) + 1:
        bad.append("data.next_batch")
    return {
        "step": step,
        "bad": bad,
        "tier": info.tier if info else None,
        "local": info.bytes_local if info else 0,
        "peer": info.bytes_peer if info else 0,
        "persistent": info.bytes_persistent if info else 0,
        "skipped": list(info.skipped) if info else [],
    }


def _bitwise(a: Any, b: Any) -> bool:
    """Equal as integers (NaN payloads and -0.0 count)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)
