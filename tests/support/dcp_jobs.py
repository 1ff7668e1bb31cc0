"""torch DCP's own ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` through reshard_svc's
storage writer and reader, with FSDP2 × TP and AdamW state (spawned gloo workers)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tests.support import training
from tests.support.fast_jobs import _bitwise
from tests.support.manager_jobs import _state, full_state


def save_through_writer(uri: str, ref: str, mode: str) -> None:
    """Train 2 steps at FSDP 2 × TP 2, save with ``dcp.save`` (or ``dcp.async_save``)
    through :class:`reshard_svc.dcp.Writer`; rank 0 keeps the state as it was in ``ref``."""
    import torch.distributed.checkpoint as dcp

    from reshard_svc.dcp import Writer

    model, optim, dp_mesh = training.build(2, 2)
    training.train(model, optim, range(1, 3), dp_mesh)
    state = _state(model, optim)
    if mode == "async":
        dcp.async_save(state, storage_writer=Writer(uri)).result()
    else:
        dcp.save(state, storage_writer=Writer(uri))
    full = full_state(state)
    if dist.get_rank() == 0:
        save_file(full, ref)


def load_through_reader(uri: str, ref: str, tp: int, dp: int, how: str) -> list[str]:
    """Another world and layout: ``dcp.load`` through :class:`reshard_svc.dcp.Reader` (or
    ``reshard_svc.load``); the names that differ from ``ref``, bitwise."""
    import torch.distributed.checkpoint as dcp

    import reshard_svc
    from reshard_svc.dcp import Reader

    model, optim, _ = training.build(tp, dp)
    training.train(model, optim, range(1))  # optimizer state to load into
    state = _state(model, optim)
    if how == "dcp":
        dcp.load(state, storage_reader=Reader(uri))
    else:
        reshard_svc.load(state, uri)
    got, want = full_state(state), load_file(ref)
    return [k for k in want if k not in got or not _bitwise(got[k], want[k])]


def killed_before_finish(uri: str) -> Any:
    """``dcp.save`` whose coordinator is killed (SIGKILL) right before the commit."""
    import torch
    import torch.distributed.checkpoint as dcp

    from reshard_svc.dcp import Writer

    class Dies(Writer):
        def finish(self, metadata: Any, results: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

    dcp.save({"w": torch.ones(64, 64) * dist.get_rank()}, storage_writer=Dies(uri))


def _torchtnt() -> tuple[Any, Any]:
    """torchtnt's DCP checkpointer configured with our writer and reader (the docs' class,
    run as written), and a train unit over the FSDP × TP model."""
    from torchtnt.framework.unit import TrainUnit

    from tests.support.docs import block

    scope: dict[str, Any] = {}
    exec(compile(block("torchtnt-saver", "python"), "docs/bridge.md:torchtnt-saver", "exec"), scope)
    Saver = scope["Saver"]

    class Unit(TrainUnit[int]):
        def __init__(self, tp: int, dp: int) -> None:
            super().__init__()
            self.model, self.optim, self.dp_mesh = training.build(tp, dp)

        def train_step(self, state: Any, data: int) -> None:
            training.train(self.model, self.optim, range(data, data + 1), self.dp_mesh)

    return Saver, Unit


def torchtnt_train(root: str, ref: str, steps: int) -> None:
    """torchtnt's ``train`` at FSDP 2 × TP 2 with its ``DistributedCheckpointSaver`` (async,
    every 2 steps, keeping the last 2) writing our format; rank 0 keeps the state the job
    held at the end in ``ref``."""
    from torchtnt.framework.train import train

    Saver, Unit = _torchtnt()
    unit = Unit(2, 2)
    saver = Saver(
        root, save_every_n_train_steps=2, keep_last_n_checkpoints=2, async_checkpoint=True
    )
    train(unit, list(range(1, steps + 1)), max_epochs=1, callbacks=[saver])
    full = full_state(_state(unit.model, unit.optim))
    if dist.get_rank() == 0:
        save_file(full, ref)


def torchtnt_resume(root: str, ref: str) -> dict[str, Any]:
    """A fresh job at TP 2 (2 ranks) resumes with torchtnt's ``restore_from_latest`` through
    our reader: the names that differ from ``ref`` (bitwise) and the step it resumed at."""
    Saver, Unit = _torchtnt()
    unit = Unit(2, 1)
    training.train(unit.model, unit.optim, range(1))  # optimizer state to load into
    if not Saver.restore_from_latest(root, unit):
        return {"restored": False}
    got, want = full_state(_state(unit.model, unit.optim)), load_file(ref)
    return {
        "restored": True,
        "differ": [k for k in want if k not in got or not _bitwise(got[k], want[k])],
        "step": unit.train_progress.num_steps_completed,
    }
