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


def save_until_killed(root: str, paths: list[str], nodes: list[int], out: str, launch: int) -> None:
    """Resume (checking the state bitwise against the step it says), then save a
    step-valued state every step, fast every step, until killed; after the first fast save
    of this launch each rank records what its node's fast path holds."""
    import json

    import torch

    from reshard_svc import CheckpointManager
    from reshard_svc.format.fast import fast_steps
    from tests.support.manager_jobs import full_value_of, value_of

    rank = dist.get_rank()
    state = value_of(-1)
    mgr = CheckpointManager(root, interval=1000, fast=_tier(paths, nodes))
    step = mgr.load(state)
    whole = state["w"].full_tensor()
    ok = step is None or (
        torch.equal(whole, full_value_of(step)["w"]) and state["meta"]["step"] == step
    )
    start = (step or 0) + 1
    mgr.save(start, value_of(start))
    mgr.wait()
    held = fast_steps(paths[nodes[rank]])
    record = {
        "step": step,
        "ok": ok,
        "tier": mgr.last_restore.tier if mgr.last_restore else None,
        "committed": [s.step for s in held if s.committed],
        "unfinished": [s.step for s in held if not s.committed],
    }
    path = os.path.join(out, f"launch-{launch}-rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    for s in range(start + 1, start + 100_000):
        mgr.save(s, value_of(s))


def train_until(
    root: str, paths: list[str], nodes: list[int], steps: int, kill_at: int | None, final: str
) -> int:
    """FSDP × TP with AdamW (fast every step, persistent never): resume, train to
    ``steps``; rank 1 kills itself with SIGKILL right after ``kill_at``'s save (its fast
    step may or may not have committed). Rank 0 writes the final state to ``final``."""
    import signal

    from reshard_svc import CheckpointManager

    model, optim, dp_mesh = training.build(2, 2)
    mgr = CheckpointManager(root, interval=1000, fast=_tier(paths, nodes))
    training.train(model, optim, range(1), dp_mesh)  # optimizer state to load into
    state = {**_state(model, optim), "data": {"next_batch": 1}}
    loaded = mgr.load(state)
    if loaded is None:  # a fresh start: the untouched model and optimizer
        model, optim, dp_mesh = training.build(2, 2)
    start = (loaded or 0) + 1
    if state["data"]["next_batch"] != start:
        raise RuntimeError(f"resumed at {start} but the data position says {state['data']}")
    for step in range(start, steps + 1):
        training.train(model, optim, range(step, step + 1), dp_mesh)
        mgr.save(step, {**_state(model, optim), "data": {"next_batch": step + 1}})
        if step == kill_at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.wait()
    full = full_state(_state(model, optim))
    if dist.get_rank() == 0:
        save_file(full, final)
    mgr.close()
    return start


def save_values(root: str, paths: list[str], nodes: list[int], steps: int) -> None:
    """A step-valued state saved every step (fast every step, the root every 4); ends as a
    kill would."""
    from reshard_svc import CheckpointManager
    from tests.support.manager_jobs import value_of

    mgr = CheckpointManager(root, interval=4, fast=_tier(paths, nodes))
    for step in range(1, steps + 1):
        mgr.save(step, value_of(step))
    mgr.wait()


def load_values(root: str, paths: list[str], nodes: list[int]) -> dict[str, Any]:
    """``mgr.load`` of a step-valued state: the step, whether every byte is that step's,
    and where the bytes came from."""
    import torch

    from reshard_svc import CheckpointManager
    from tests.support.manager_jobs import full_value_of, value_of

    state = value_of(-1)
    with CheckpointManager(root, fast=_tier(paths, nodes)) as mgr:
        step = mgr.load(state)
        info = mgr.last_restore
    ok = step is not None and torch.equal(state["w"].full_tensor(), full_value_of(step)["w"])
    return {"step": step, "ok": ok, "tier": info.tier, "persistent": info.bytes_persistent}
