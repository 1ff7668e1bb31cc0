"""Checkpoints written by other projects' own code, on gloo workers: the bridge's oracles.

* :func:`write_torch_checkpointing`: the test transformer (tests/support/training.py)
  trained one AdamW step under FSDP2, TP or FSDP2 × TP, saved by ``torch_checkpointing.CheckpointManager`` (its model and
  optimizer state dicts, from ``torch.distributed.checkpoint.state_dict``, plus a ``step``
  item with no resharder).
* :func:`write_megatron`: a ``ShardedTensor`` state dict as Megatron-Core's GPT layers
  build it (stacked layers along a prepended axis, TP splits, replicated norms, experts
  along a second prepended axis split by expert parallelism), saved by
  ``megatron.core.dist_checkpointing.save`` (the ``torch_dist`` backend), with
  ``iteration`` and ``args`` in its ``common.pt``.

Each rank 0 also writes ``ref.safetensors``: every tensor the writer saved, whole, under
the name reshard_svc gives it, built from the same values the writer was handed.

Running these writers on CPU needs three shims, all for code paths that assume CUDA
(documented in the README): torch_checkpointing 0.1.1 gathers its metadata through a
``device="cuda"`` tensor (``DefaultMetadataManager._all_gather_pickled_data``) and opens
files with ``O_DIRECT`` (``use_direct_io=False`` is its own switch); megatron-core 0.16.1
calls ``torch.cuda.synchronize`` and ``torch.cuda.current_device`` after writing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

H, F, VOCAB, LAYERS = 16, 32, 32, 2  # the Megatron-style state dict's sizes


def flatten_full(tree: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Every tensor of a nested state (dicts, lists) under dotted names, whole."""
    if isinstance(tree, torch.Tensor):
        full = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
        out[prefix] = full.detach().clone().contiguous()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            flatten_full(v, f"{prefix}.{k}", out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            flatten_full(v, f"{prefix}.{i}", out)


def _cpu_shims_for_torch_checkpointing() -> None:
    from torch_checkpointing import metadata_manager

    def gather(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
        out: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    metadata_manager.DefaultMetadataManager._all_gather_pickled_data = gather


def _tc_save(out: str, state: dict[str, Any], items: tuple[str, ...]) -> None:
    """One synchronous ``CheckpointManager`` save; ``items`` get the default resharder
    (the others are saved without one, as opaque per-rank files)."""
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    _cpu_shims_for_torch_checkpointing()
    config = CheckpointManager.Config(
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        items={item: ItemSpec(resharder=DefaultResharder()) for item in items},
        save=CheckpointManager.Config.with_sync_save().save,
    )
    done = CheckpointManager(config).save(out, state)
    if hasattr(done, "result"):
        done.result()


def write_torch_checkpointing(out: str, ref: str, parallel: str) -> str:
    """Train one step under ``parallel`` (fsdp, tp, fsdp_tp) and save with torch_checkpointing."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from tests.support import training

    tp, dp = {"fsdp": (1, 2), "tp": (2, 1), "fsdp_tp": (2, 2)}[parallel]
    model, opt, dp_mesh = training.build(tp, dp)
    training.train(model, opt, range(1), dp_mesh)
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, opt)
    refs: dict[str, torch.Tensor] = {}
    flatten_full(model_sd, "model", refs)
    flatten_full(optim_sd, "optim", refs)
    _tc_save(out, {"model": model_sd, "optim": optim_sd, "step": 7}, ("model", "optim"))
    dist.barrier()
    if dist.get_rank() == 0:
        save_file(refs, ref)
    return "written"


def megatron_reference(ep: int = 2) -> dict[str, torch.Tensor]:
    """The whole tensors :func:`write_megatron` saves, by sharded key."""
    g = torch.Generator().manual_seed(3)
    experts = 2 * ep
    return {
        "embedding.word_embeddings.weight": torch.randn(VOCAB, H, generator=g),
        "decoder.layers.self_attention.linear_qkv.weight": torch.randn(
            LAYERS, 3 * H, H, generator=g
        ),
        "decoder.layers.self_attention.linear_proj.weight": torch.randn(LAYERS, H, H, generator=g),
        "decoder.layers.input_layernorm.weight": torch.randn(LAYERS, H, generator=g),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": torch.randn(
            LAYERS, experts, F, H, generator=g
        ),
        "decoder.final_layernorm.weight": torch.randn(H, generator=g),
    }


def write_megatron(out: str, ref: str) -> str:
    """Save a Megatron-style sharded state dict with ``dist_checkpointing.save`` (TP = EP =
    world size)."""
    import os

    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    rank, tp = dist.get_rank(), dist.get_world_size()
    full = megatron_reference(tp)
    sd: dict[str, Any] = {"layers": [], "experts": []}

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim)[rank].clone()

    emb = "embedding.word_embeddings.weight"
    sd[emb] = ShardedTensor.from_rank_offsets(emb, part(full[emb], 0), (0, rank, tp), replica_id=0)
    for layer in range(LAYERS):
        for key, dim in (
            ("decoder.layers.self_attention.linear_qkv.weight", 0),
            ("decoder.layers.self_attention.linear_proj.weight", 1),
        ):  # column / row parallel within each layer, layers stacked on a prepended axis
            sd["layers"].append(
                ShardedTensor.from_rank_offsets(
                    key,
                    part(full[key][layer], dim),
                    (0, layer, LAYERS),
                    (dim + 1, rank, tp),
                    replica_id=0,
                    prepend_axis_num=1,
                )
            )
        norm = "decoder.layers.input_layernorm.weight"
        sd["layers"].append(
            ShardedTensor.from_rank_offsets(
                norm,
                full[norm][layer].clone(),
                (0, layer, LAYERS),
                replica_id=rank,
                prepend_axis_num=1,
            )
        )
        fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
        experts = full[fc1].shape[1]
        for e in range(rank * experts // tp, (rank + 1) * experts // tp):  # expert parallel
            sd["experts"].append(
                ShardedTensor.from_rank_offsets(
                    fc1,
                    full[fc1][layer, e].clone(),
                    (0, layer, LAYERS),
                    (1, e, experts),
                    replica_id=0,
                    prepend_axis_num=2,
                )
            )
    final = "decoder.final_layernorm.weight"
    sd[final] = ShardedTensor.from_rank_offsets(final, full[final].clone(), replica_id=rank)
    sd["iteration"] = 42
    sd["args"] = {"lr": 0.1, "model": "gpt", "layers": LAYERS}
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(sd, out)
    dist.barrier()
    if rank == 0:
        save_file(full, ref)
    return "written"


def load_and_compare(uri: str, ref: str) -> list[str]:
    """Load every tensor of ``ref`` from ``uri`` into a third layout (2-D and larger:
    Shard(1) over this world; others replicated) and name any that differ from ``ref``."""
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import reshard_svc

    want = load_file(ref)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1) if v.dim() > 1 else Replicate()])
        for k, v in want.items()
    }
    reshard_svc.load(sd, uri)
    return [k for k, v in sd.items() if not torch.equal(v.full_tensor(), want[k])]


def write_torch_checkpointing_big(out: str, mib: int) -> str:
    """``mib`` MiB of fp32 DTensors (rows sharded over the world), one torch_checkpointing
    save; the values are a function of their position, so any reader can check them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {
        name: distribute_tensor(full, mesh, [Shard(0)]) for name, full in big_tensors(mib).items()
    }
    _tc_save(out, {"model": sd}, ("model",))
    return "written"


def big_tensors(mib: int) -> dict[str, torch.Tensor]:
    n = mib * 2**20 // 4 // 4 // 256  # rows of each of four [n, 256] fp32 tensors
    return {
        f"w{i}": torch.arange(n * 256, dtype=torch.float32).reshape(n, 256) + i for i in range(4)
    }


def write_torch_checkpointing_divergent(out: str) -> str:
    """Per-rank experts passed as plain tensors under one key — what torch_checkpointing
    0.1.1 saves as "replicated" with a log line, each rank's copy in its own file."""

    rank = dist.get_rank()
    sd = {"experts.w": torch.full((2, 4), float(rank)), "bias": torch.ones(4)}
    _tc_save(out, {"model": sd}, ("model",))
    return "written"


# ---------------------------------------------------------------- a real Megatron-Core GPTModel

GPT_LAYERS, GPT_EXPERTS = 2, 4


def _megatron_cpu_shims() -> None:
    """megatron-core 0.16.1 on CPU: the synchronize/current_device calls after writing,
    ``device="cuda"`` scalars its optimizers allocate, and the grouped-GEMM kernel check of
    ``GroupedMLP`` (its kernels are CUDA-only; building the module and its state dict is
    plain torch)."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    real = torch.tensor

    def tensor(*args: Any, device: Any = None, **kw: Any) -> torch.Tensor:
        cuda = device == "cuda" or getattr(device, "type", None) == "cuda"
        return real(*args, device="cpu" if cuda else device, **kw)

    torch.tensor = tensor  # type: ignore[assignment]
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None


def _gpt(tp: int, ep: int, grouped: bool) -> tuple[Any, Any]:
    """A GPTModel (local layer spec: no Transformer Engine) with GLU MoE experts, grouped
    (``GroupedMLP``) or sequential (``SequentialMLP``), and its Megatron Adam optimizer."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    _megatron_cpu_shims()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep
    )
    torch.manual_seed(11)
    config = TransformerConfig(
        num_layers=GPT_LAYERS,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=32,
        num_moe_experts=GPT_EXPERTS,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_grouped_gemm=grouped,
        moe_use_legacy_grouped_gemm=grouped,
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=GPT_EXPERTS, moe_grouped_gemm=grouped, moe_use_legacy_grouped_gemm=grouped
    )
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=8
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optim = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [ddp])
    return model, optim


def write_megatron_gpt(out: str, grouped: bool) -> str:
    """TP 2 × EP 2 on 4 ranks: one Adam step (the inner torch optimizers step on random
    gradients: Megatron's own step wants CUDA), then ``dist_checkpointing.save`` of the
    model's and the optimizer's sharded state dicts."""
    import os

    from megatron.core import dist_checkpointing

    model, optim = _gpt(2, 2, grouped)
    g = torch.Generator().manual_seed(dist.get_rank())
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    for inner in getattr(optim, "chained_optimizers", [optim]):
        inner.optimizer.step()
    sd = {"model": model.sharded_state_dict()}
    sd["optimizer"] = optim.sharded_state_dict(sd["model"])
    sd["iteration"] = 5
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(sd, out)
    return "written"


def megatron_gpt_stacks(ckpt: str, grouped: bool, out: str) -> str:
    """Megatron's own reading of ``ckpt``: ``dist_checkpointing.load`` into a TP 1 × EP 1
    model, then every sharded tensor of that model (its own ``sharded_state_dict``, swiglu
    factories built) placed at its global offsets: the stacked ``[L, (E,) ...]`` tensor of
    each sharded key, as Megatron itself sees it, saved to ``out`` (safetensors)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    model, _ = _gpt(1, 1, grouped)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
    model.load_state_dict(loaded, strict=False)  # _extra_state items are TE's, not ours
    stacks: dict[str, torch.Tensor] = {}

    def place(item: Any) -> None:
        if isinstance(item, ShardedTensorFactory):
            place(item.build())
        elif isinstance(item, dict):
            for v in item.values():
                place(v)
        elif isinstance(item, (list, tuple)):
            for v in item:
                place(v)
        elif isinstance(item, ShardedTensor) and not item.key.endswith("_extra_state"):
            full = stacks.setdefault(item.key, torch.zeros(item.global_shape, dtype=item.dtype))
            local = (1,) * item.prepend_axis_num + tuple(item.local_shape)
            where = tuple(slice(o, o + n) for o, n in zip(item.global_offset, local))
            full[where] = item.data.reshape(local)

    place(model.sharded_state_dict())
    save_file(stacks, out)
    return "written"


# ---------------------------------------------------------------- torch_checkpointing under HSDP


def _fsdp(mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.support import training

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = training.Transformer()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    betas = (0.8, 0.9)  # not the defaults: a load that drops param_groups shows
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, betas=betas, weight_decay=0.1)


def write_torch_checkpointing_hsdp(out: str, ref: str) -> str:
    """FSDP2 HSDP (dp_replicate 2 × dp_shard 2), one AdamW step, saved by torch_checkpointing;
    rank 0 writes every full tensor to ``ref`` and the param_groups to ``ref``.json."""
    import json

    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from tests.support import training

    model, opt = _fsdp((2, 2), ("replicate", "shard"))
    training.train(model, opt, range(1))  # every rank the same batch: replicas agree
    model_sd, optim_sd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    refs: dict[str, torch.Tensor] = {}
    flatten_full(model_sd, "model", refs)
    flatten_full(optim_sd["state"], "optim.state", refs)
    _tc_save(out, {"model": model_sd, "optim": optim_sd}, ("model", "optim"))
    dist.barrier()
    if dist.get_rank() == 0:
        save_file(refs, ref)
        with open(ref + ".json", "w") as f:
            json.dump(optim_sd["param_groups"], f)
    return "written"


def load_fsdp_and_compare(uri: str, ref: str) -> list[str]:
    """FSDP2 on this world: ``reshard_svc.load`` model and optimizer state, applied with
    ``set_optimizer_state_dict``; names every tensor or param_groups value that differs."""
    import json

    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import reshard_svc
    from tests.support import training

    model, opt = _fsdp((dist.get_world_size(),), ("dp",))
    opt.param_groups[0]["lr"] = 0.5  # what the load must overwrite
    training.train(model, opt, range(1, 2))  # optimizer state exists to load into
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    reshard_svc.load(state, uri)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    got: dict[str, torch.Tensor] = {}
    flatten_full(get_model_state_dict(model), "model", got)
    after = get_optimizer_state_dict(model, opt)
    flatten_full(after["state"], "optim.state", got)
    want = load_file(ref)
    bad = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
    with open(ref + ".json") as f:
        groups = json.load(f)
    for i, (g, w) in enumerate(zip(after["param_groups"], groups, strict=True)):
        bad += [
            f"param_groups.{i}.{k}"
            for k, v in w.items()
            if k != "params" and (list(g[k]) if isinstance(g[k], tuple) else g[k]) != v
        ]
    return bad
