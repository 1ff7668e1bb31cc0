"""A small transformer trained with torch's own TP (and FSDP2) APIs, for the resume tests.

Spawned worker processes import these module-level functions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, FFN, LAYERS, SEQ, BATCH = 64, 32, 4, 64, 2, 8, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head_dim = DIM // HEADS
        q = self.wq(x).view(b, s, -1, head_dim).transpose(1, 2)  # local heads under TP
        k = self.wk(x).view(b, s, -1, head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def block_tp_plan() -> dict:
    """torch TP for one Block: column-parallel q/k/v and w1/w3, row-parallel wo and w2."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2")
    where = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention"}
    return {
        f"{where.get(n, 'feed_forward')}.{n}": (
            ColwiseParallel() if n in col else RowwiseParallel()
        )
        for n in (*col, *row)
    }


def build(tp: int, dp: int = 1):
    """The model parallelized with ColwiseParallel/RowwiseParallel at TP=tp (blocks with
    activation checkpointing and input_reshard), FSDP2 on a dp axis when dp > 1 (alone,
    on a 1-D mesh, when tp == 1); AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.parallel.input_reshard import input_reshard

    torch.manual_seed(0)  # identical init on every rank and in every run
    model = Transformer()
    if tp == 1 and dp > 1:  # FSDP2 alone, on a 1-D mesh
        from torch.distributed.fsdp import fully_shard

        dp_mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), dp_mesh
    if dp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        tp_mesh = mesh["tp"]
    else:
        mesh = tp_mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_tp_plan())
    # input_reshard goes with activation checkpointing: only the (replicated) block input is
    # saved, sharded on the sequence dim between forward and the recompute in backward.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    for i, block in enumerate(model.layers):
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        model.layers[i] = input_reshard(wrapped, tp_mesh, 1)
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim, (mesh["dp"] if dp > 1 else None)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(model, optim, steps: range, dp_mesh=None) -> list[float]:
    """One optimizer step per batch; under FSDP each dp rank takes its slice of the batch."""
    losses = []
    for step in steps:
        x, y = batch(step)
        if dp_mesh is not None:
            n, i = dp_mesh.size(), dp_mesh.get_local_rank()
            x, y = x.chunk(n)[i], y.chunk(n)[i]
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        value = loss.detach().clone()
        if dp_mesh is not None:
            dist.all_reduce(value, group=dp_mesh.get_group())
            value /= dp_mesh.size()
        losses.append(float(value))
    return losses


def full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def full_optim(model, optim) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    _, osd = get_state_dict(model, optim)
    out = {}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{fqn}.{k}"] = (
                    (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                )
    return out


def first_run(path: str) -> dict:
    """TP=4: 3 steps, save model+optim with reshard_svc, then 3 more (the uninterrupted run)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import reshard_svc

    model, optim, _ = build(tp=4)
    train(model, optim, range(3))
    model_sd, optim_sd = get_state_dict(model, optim)
    reshard_svc.save({"model": model_sd, "optim": optim_sd, "step": 3}, path)
    saved = full_params(model)
    saved_optim = full_optim(model, optim)
    later = train(model, optim, range(3, 6))
    rank0 = dist.get_rank() == 0
    return {
        "saved": saved if rank0 else None,
        "optim": saved_optim if rank0 else None,
        "losses": later,
    }


def resume(path: str, tp: int, dp: int = 1) -> dict:
    """Rebuild at another layout, load with reshard_svc + set_state_dict, train 3 steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import reshard_svc

    model, optim, dp_mesh = build(tp=tp, dp=dp)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    reshard_svc.load(state, path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full_params(model)
    loaded_optim = full_optim(model, optim)
    losses = train(model, optim, range(state["step"], state["step"] + 3), dp_mesh)
    rank0 = dist.get_rank() == 0
    return {
        "loaded": loaded if rank0 else None,
        "optim": loaded_optim if rank0 else None,
        "losses": losses,
        "step": state["step"],
    }


def async_snapshot(path: str) -> dict:
    """async_save returns once staged; mutating right after must not leak into the file."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import reshard_svc

    model, optim, _ = build(tp=2)
    train(model, optim, range(2))
    model_sd, optim_sd = get_state_dict(model, optim)
    before = full_params(model)
    future = reshard_svc.async_save({"model": model_sd, "optim": optim_sd}, path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)  # training goes on and changes everything
    future.result()
    # A second save waits for nothing (the first is done) and commits atomically over it.
    future2 = reshard_svc.async_save({"model": model_sd, "optim": optim_sd}, path + "-2")
    future2.result()
    fresh, fresh_optim, _ = build(tp=2)
    fm, fo = get_state_dict(fresh, fresh_optim)
    reshard_svc.load({"model": fm, "optim": fo}, path)
    fresh.load_state_dict(fm)
    got = full_params(fresh)
    same = all(torch.equal(got[k], before[k]) for k in before)
    # A target that cannot be written fails fast, at the call, with a typed error
    # (its lease is written before anything is staged).
    from reshard_svc.errors import ReshardError

    try:
        reshard_svc.async_save({"model": model_sd}, "/proc/definitely/not/writable").result()
        error = None
    except ReshardError as e:
        error = type(e).__name__
    return {"same": same, "error": error}


def fsdp_resave(src: str, dst: str) -> None:
    """Load into the (dp=2, tp=2) FSDP2 model and save from it: norms live on the dp
    sub-mesh there, replicated across tp columns the DTensor itself does not show."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import reshard_svc

    model, optim, _ = build(tp=2, dp=2)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    reshard_svc.load(state, src)
    reshard_svc.save(state, dst)
