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
