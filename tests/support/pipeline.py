"""Pipeline-parallel and expert-parallel jobs for the layout tests: each rank passes only the
keys it holds.

A PP x TP job is split the torchtitan way: every rank builds the whole model, deep-copies
it, deletes the layers other stages own (``layers`` is a ``ModuleDict`` so names keep
their index), and applies torch's own TP (``parallelize_module``) on its stage's TP
sub-mesh; a stage with TP=1 holds plain tensors. The optimizer state is flattened per
parameter (``flatten_optimizer_state_dict=True``), as torchtitan saves it. Spawned worker
processes import these module-level functions.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.support.training import DIM, VOCAB, Block, block_tp_plan

LAYERS = 4
SEQ, BATCH = 8, 4


class Staged(nn.Module):
    """A transformer whose parts a stage may lack (torchtitan's PP split)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: nn.Module | None = nn.RMSNorm(DIM)
        self.output: nn.Module | None = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None and self.output is not None:
            h = self.output(self.norm(h))
        return h


def stage_layers(stage: int, pp: int) -> list[int]:
    per = LAYERS // pp
    return list(range(stage * per, (stage + 1) * per))


def _tp_plan(model: Staged, tp_mesh: Any) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    top: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        top["output"] = ColwiseParallel(output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_tp_plan())


def build(pp: int, tp: int) -> tuple[Staged, Any, int]:
    """This rank's stage of the model (PP x TP over the world), its AdamW, its stage."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    full = Staged()
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_local_rank("pp")
    model = copy.deepcopy(full)
    keep = set(stage_layers(stage, pp))
    for i in range(LAYERS):
        if i not in keep:
            del model.layers[str(i)]
    if stage != 0:
        model.tok_embeddings = None
    if stage != pp - 1:
        model.norm = model.output = None
    if tp > 1:
        _tp_plan(model, mesh["tp"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim, stage


def build_flat(tp: int) -> tuple[Staged, Any]:
    """The whole model (no PP) at TP=tp over the world."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Staged()
    if tp > 1:
        _tp_plan(model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: Staged, optim: Any, stage: int, steps: range) -> None:
    """Each stage trains its own layers on its own (deterministic) inputs: the first on
    tokens, the others on hidden states; the last has the loss head."""
    for step in steps:
        g = torch.Generator().manual_seed(1000 * stage + step)
        if model.tok_embeddings is not None:
            x: torch.Tensor = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        else:
            x = torch.randn(BATCH, SEQ, DIM, generator=g)
        out = model(x)
        if model.output is not None:
            y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            loss = F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
        else:
            loss = out.pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def state(model: Staged, optim: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optim, options=opts)
    return {"model": model_sd, "optim": optim_sd}


def put(model: Staged, optim: Any, sd: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    set_state_dict(
        model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=opts
    )


def full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict, whole (a collective on DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for part in ("model", "optim"):
        for k, v in sd[part].items():
            if isinstance(v, torch.Tensor):
                whole = v.full_tensor() if isinstance(v, DTensor) else v
                out[f"{part}.{k}"] = whole.detach().clone()
    return out


def _first_of_stage(pp: int) -> bool:
    return dist.get_rank() % (dist.get_world_size() // pp) == 0


def pp_save(path: str, pp: int, tp: int) -> dict[str, Any]:
    """Train 2 steps, save (each rank its own stage's keys), then train one more."""
    import reshard_svc

    model, optim, stage = build(pp, tp)
    train(model, optim, stage, range(2))
    sd = state(model, optim)
    reshard_svc.save({**sd, "step": 2}, path)
    saved = full(sd)
    train(model, optim, stage, range(2, 3))
    after = full(state(model, optim))
    first = _first_of_stage(pp)
    return {
        "stage": stage,
        "saved": saved if first else None,
        "after": after if first else None,
        "keys": sorted(sd["model"]),
    }


def pp_resume(path: str, pp: int, tp: int) -> dict[str, Any]:
    """Load into this PP x TP layout (each rank its stage's keys); train one step."""
    import reshard_svc

    model, optim, stage = build(pp, tp)
    sd = state(model, optim)
    target = {**sd, "step": 0}
    reshard_svc.load(target, path)
    put(model, optim, target)
    loaded = full(state(model, optim))
    train(model, optim, stage, range(target["step"], target["step"] + 1))
    after = full(state(model, optim))
    first = _first_of_stage(pp)
    return {
        "stage": stage,
        "loaded": loaded if first else None,
        "after": after if first else None,
        "step": target["step"],
    }


def flat_load(path: str, tp: int) -> dict[str, Any]:
    """Load the whole model at TP=tp without PP (every rank asks for every key)."""
    import reshard_svc

    model, optim = build_flat(tp)
    sd = state(model, optim)  # (get_state_dict creates the optimizer's state, lr=0)
    reshard_svc.load(sd, path)
    put(model, optim, sd)
    got = full(state(model, optim))
    return {"loaded": got if dist.get_rank() == 0 else None}


# ---------------------------------------------------------------- expert parallel

E, F_DIM, H_DIM = 4, 6, 5


def experts(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(E, F_DIM, H_DIM, generator=g).to(torch.bfloat16)


def _dt(mesh: Any, placements: str, value: torch.Tensor) -> Any:
    from torch.distributed.tensor import distribute_tensor

    from reshard_svc.layout import parse_placements
    from reshard_svc.runtime import _compat

    return distribute_tensor(value, mesh, _compat.to_torch_placements(parse_placements(placements)))


def ep_state(ep: int, tp: int, zeros: bool = False) -> dict[str, Any]:
    """Experts on an (ep, tp) mesh: w1 as a DTensor (Shard(0) over ep, Shard(1) over tp),
    w2 as plain local experts each ep rank passes as a LocalShard (its tp ranks pass the
    same box: replicas)."""
    from torch.distributed.device_mesh import init_device_mesh

    from reshard_svc import LocalShard

    mesh = init_device_mesh("cpu", (ep, tp), mesh_dim_names=("ep", "tp"))
    w1 = experts("moe.w1")
    w2 = experts("moe.w2")
    if zeros:
        w1, w2 = torch.zeros_like(w1), torch.zeros_like(w2)
    r = mesh.get_local_rank("ep")
    per = -(-E // ep)
    lo, hi = min(E, r * per), min(E, (r + 1) * per)
    local = w2[lo:hi].clone()
    return {
        "moe.w1": _dt(mesh, "S(0),S(1)", w1),
        "moe.w2": LocalShard(local, (E, F_DIM, H_DIM), (lo, 0, 0)),
    }


def ep_save(path: str, ep: int, tp: int) -> None:
    import reshard_svc

    reshard_svc.save(ep_state(ep, tp), path)


def ep_load(path: str, ep: int, tp: int, replicated: bool = False) -> dict[str, Any]:
    """Load into another (ep, tp); ``replicated``: every rank the whole of both."""
    import reshard_svc

    if replicated:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ep, tp), mesh_dim_names=("ep", "tp"))
        sd = {
            n: _dt(mesh, "R,R", torch.zeros(E, F_DIM, H_DIM, dtype=torch.bfloat16))
            for n in ("moe.w1", "moe.w2")
        }
    else:
        sd = ep_state(ep, tp, zeros=True)
    reshard_svc.load(sd, path)
    ok = {}
    for name, v in sd.items():
        want = experts(name)
        if hasattr(v, "to_local"):
            ok[name] = torch.equal(v.full_tensor(), want)
        else:
            lo = v.offsets[0]
            ok[name] = torch.equal(v.tensor, want[lo : lo + v.tensor.shape[0]])
    return ok


# ---------------------------------------------------------------- replicas


def divergent(path: str, case: str) -> dict[str, Any]:
    """Replicas that differ must be refused on every rank with nothing committed."""
    import os

    import reshard_svc
    from reshard_svc.errors import ReplicaMismatchError

    rank = dist.get_rank()
    if case == "plain":
        sd: dict[str, Any] = {"experts.w": torch.full((2, 4), float(rank))}
    elif case == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        t = _dt(mesh, "R", torch.ones(3, 3))
        if rank == 1:
            t.to_local()[1, 1] = 7.0  # one rank drifted
        sd = {"norm.weight": t}
    elif case == "extras":
        sd = {"w": torch.ones(2), "seed": 1234 + rank}
    elif case == "async":
        sd = {"experts.w": torch.full((2, 4), float(rank))}
    else:  # identical replicas are fine, and so is a divergence the caller opts out of
        sd = {"experts.w": torch.ones(2, 4), "step": 5}
    try:
        if case == "async":
            reshard_svc.async_save(sd, path).result()
        elif case == "unchecked":
            sd = {"experts.w": torch.full((2, 4), float(rank))}
            reshard_svc.save(sd, path, check_replicas=False)
        else:
            reshard_svc.save(sd, path)
        error = None
    except ReplicaMismatchError as e:
        error = str(e)
    except Exception as e:  # anything else is a failure of the test
        error = f"UNEXPECTED {type(e).__name__}: {e}"
    parent = os.path.dirname(path)
    dist.barrier()
    return {"error": error, "left": sorted(os.listdir(parent))}
