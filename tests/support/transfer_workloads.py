"""Worker functions for the live weight sync tests: a small Llama-shaped model on a trainer
mesh, pushed into an inference mesh of the same 8-process gloo world.

Sources are built by torch's own ``distribute_tensor`` from deterministic full tensors, and
each inference rank's result is compared with ``torch.equal`` against ``distribute_tensor``
of the expected full tensor (the sources' ``full_tensor()``, concatenated where fused).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

H, KV, INTER, VOCAB, LAYERS = 16, 8, 24, 37, 2
SENTINEL = -7.0

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def trainer_params() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Hugging Face Llama names and shapes (bf16 matrices, fp32 norms)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((VOCAB, H), torch.bfloat16),
        "model.norm.weight": ((H,), torch.float32),
        "lm_head.weight": ((VOCAB, H), torch.bfloat16),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": ((H, H), torch.bfloat16),
            p + "self_attn.k_proj.weight": ((KV, H), torch.bfloat16),
            p + "self_attn.v_proj.weight": ((KV, H), torch.bfloat16),
            p + "self_attn.o_proj.weight": ((H, H), torch.bfloat16),
            p + "mlp.gate_proj.weight": ((INTER, H), torch.bfloat16),
            p + "mlp.up_proj.weight": ((INTER, H), torch.bfloat16),
            p + "mlp.down_proj.weight": ((H, INTER), torch.bfloat16),
            p + "input_layernorm.weight": ((H,), torch.float32),
            p + "post_attention_layernorm.weight": ((H,), torch.float32),
        }
    return out


def fused_names() -> dict[str, Any]:
    """Inference name -> source name or Cat: vLLM's fused qkv_proj and gate_up_proj."""
    from reshard_svc import Cat

    names: dict[str, Any] = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        names[a + "qkv_proj.weight"] = Cat(
            (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), dim=0
        )
        names[m + "gate_up_proj.weight"] = Cat((m + "gate_proj.weight", m + "up_proj.weight"))
    return names


def inference_params() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    params = trainer_params()
    out = {}
    fused = fused_names()
    used = {s for c in fused.values() for s in c.sources}
    for target, cat in fused.items():
        shape0 = sum(params[s][0][0] for s in cat.sources)
        out[target] = ((shape0, H), torch.bfloat16)
    out |= {n: v for n, v in params.items() if n not in used}
    return out


def full(name: str, scale: float = 1.0) -> torch.Tensor:
    shape, dtype = trainer_params()[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def expected(target: str, scale: float = 1.0) -> torch.Tensor:
    cat = fused_names().get(target)
    if cat is None:
        return full(target, scale)
    return torch.cat([full(s, scale) for s in cat.sources], dim=cat.dim)


def tp_placements(name: str) -> list[str]:
    """vLLM-style TP: colwise Shard(0) (gate_up strided, as merged column layers hold it),
    rowwise Shard(1), vocab-parallel embeddings, replicated norms."""
    if "norm" in name:
        return ["R"]
    if "gate_up" in name:
        return ["SS(0,2)"]
    if any(k in name for k in ("o_proj", "down_proj")):
        return ["S(1)"]
    return ["S(0)"]


def fsdp_tp_placements(name: str) -> list[str]:
    """(dp, tp) trainer: FSDP2 x TP for the layers, dp-replicated embeddings and norms (so
    their bytes have two holders and the sending must spread)."""
    if "norm" in name:
        return ["R", "R"]
    if "embed" in name or "lm_head" in name:
        return ["R", "S(0)"]
    if any(k in name for k in ROWWISE):
        return ["S(0)", "S(1)"]
    return ["SS(0,2)", "S(0)"]


def _mesh(ranks: list[int], shape: tuple[int, ...] | None = None) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    t = torch.tensor(ranks, dtype=torch.int64)
    return DeviceMesh("cpu", t.view(shape) if shape else t)


def _dtensor(mesh: Any, placements: list[str], value: torch.Tensor) -> Any:
    from torch.distributed.tensor import distribute_tensor

    from reshard_svc.layout.placements import parse_placements
    from reshard_svc.runtime import _compat

    pls = _compat.to_torch_placements(parse_placements(placements))
    return distribute_tensor(value, mesh, pls, src_data_rank=None)


def _in(mesh: Any) -> bool:
    return mesh.get_coordinate() is not None


def _sources(mesh: Any, placements: Any, scale: float = 1.0) -> dict[str, Any] | None:
    if not _in(mesh):
        return None
    return {n: _dtensor(mesh, placements(n), full(n, scale)) for n in trainer_params()}


def _targets(mesh: Any, params: Any = None) -> dict[str, Any] | None:
    if not _in(mesh):
        return None
    return {
        n: _dtensor(mesh, tp_placements(n), torch.full(shape, SENTINEL, dtype=dtype))
        for n, (shape, dtype) in (params or inference_params()).items()
    }


def _wrong(dst: dict[str, Any] | None, scale: float = 1.0) -> list[str]:
    """Target names whose local shard differs from torch's shard of the expected tensor."""
    if dst is None:
        return []
    bad = []
    for name, dt in dst.items():
        want = _dtensor(dt.device_mesh, tp_placements(name), expected(name, scale)).to_local()
        if not torch.equal(dt.to_local(), want):
            bad.append(name)
    return bad


def _untouched(dst: dict[str, Any] | None) -> list[str]:
    if dst is None:
        return []
    return [n for n, dt in dst.items() if bool((dt.to_local() == SENTINEL).all())]


def _local_bytes(dst: dict[str, Any] | None) -> int:
    if dst is None:
        return 0
    return sum(dt.to_local().numel() * dt.element_size() for dt in dst.values())


def _summary(res: Any) -> dict[str, Any]:
    return {
        "updated": list(res.updated),
        "buckets": res.buckets,
        "sent": res.bytes_sent,
        "received": res.bytes_received,
        "copied": res.bytes_copied,
        "cached": res.plan_cached,
    }


def fsdp_to_tp() -> dict[str, Any]:
    """FSDP2 Shard(0) on ranks 0-3 -> TP 4 on ranks 4-7 with fused qkv and gate_up; then a
    second call (the next training step: sources changed in place) from the plan cache."""
    from reshard_svc import transfer

    trainer, inference = _mesh([0, 1, 2, 3]), _mesh([4, 5, 6, 7])
    src = _sources(trainer, lambda n: ["S(0)"])
    dst = _targets(inference)
    first = transfer(src, dst, names=fused_names())
    out = {"first": _summary(first), "wrong_first": _wrong(dst), "local_bytes": _local_bytes(dst)}
    if src is not None:
        for dt in src.values():
            dt.to_local().mul_(2)
        full_ok = all(torch.equal(dt.full_tensor(), full(n, 2.0)) for n, dt in src.items())
        out["source_full_tensor_ok"] = full_ok
    second = transfer(src, dst, names=fused_names())
    out |= {"second": _summary(second), "wrong_second": _wrong(dst, 2.0)}
    return out


def dp_tp_to_replicas() -> dict[str, Any]:
    """(dp2 x tp2) trainer on ranks 0-3 -> two inference engines, TP 2 each (ranks 4-5 and
    6-7, separate meshes)."""
    from reshard_svc import transfer

    trainer = _mesh([0, 1, 2, 3], (2, 2))
    engines = [_mesh([4, 5]), _mesh([6, 7])]
    src = _sources(trainer, fsdp_tp_placements)
    mine = [m for m in engines if _in(m)]
    dst = _targets(mine[0]) if mine else None
    res = transfer(src, dst, names=fused_names())
    return {**_summary(res), "wrong": _wrong(dst), "local_bytes": _local_bytes(dst)}


def overlapping() -> dict[str, Any]:
    """Trainer FSDP on ranks 0-5, inference TP 4 on ranks 4-7: ranks 4 and 5 are in both."""
    from reshard_svc import transfer

    trainer, inference = _mesh([0, 1, 2, 3, 4, 5]), _mesh([4, 5, 6, 7])
    src = _sources(trainer, lambda n: ["S(0)"])
    dst = _targets(inference)
    res = transfer(src, dst, names=fused_names())
    return {**_summary(res), "wrong": _wrong(dst), "local_bytes": _local_bytes(dst)}


def failure_mid_transfer(bad_rank: int, bad_bucket: int) -> dict[str, Any]:
    """A small budget makes several buckets; ``bad_rank`` raises while unpacking bucket
    ``bad_bucket`` (1-based). Every rank must raise TransferAbortedError and agree on what
    was updated; updated targets are exact, the rest untouched."""
    import torch.distributed as dist

    from reshard_svc import TransferAbortedError, transfer
    from reshard_svc.runtime import transfer as runtime

    trainer, inference = _mesh([0, 1, 2, 3]), _mesh([4, 5, 6, 7])
    src = _sources(trainer, lambda n: ["S(0)"])
    dst = _targets(inference)
    real_take, real_done = runtime.Staging.take, runtime.Staging.wave_done
    if dist.get_rank() == bad_rank:
        waves = {"done": 0}

        def wave_done(self: Any, wave: Any) -> None:
            waves["done"] += 1
            real_done(self, wave)

        def take(self: Any, piece: Any, data: Any) -> bool:
            if waves["done"] == bad_bucket - 1:
                raise RuntimeError("injected failure while unpacking")
            return real_take(self, piece, data)

        runtime.Staging.take, runtime.Staging.wave_done = take, wave_done  # type: ignore[method-assign]
    try:
        transfer(src, dst, names=fused_names(), max_memory=2048, plan_cache=None)
    except TransferAbortedError as e:
        updated, untouched = list(e.updated), list(e.untouched)
        wrong = [n for n in _wrong(dst) if n in updated]
        still = _untouched(dst)
        return {
            "raised": type(e).__name__,
            "message": str(e),
            "updated": updated,
            "untouched": untouched,
            "wrong_updated": wrong,
            "sentinel_not_untouched": [n for n in untouched if dst is not None and n not in still],
        }
    finally:
        runtime.Staging.take, runtime.Staging.wave_done = real_take, real_done  # type: ignore[method-assign]
    return {"raised": None}


def mismatches() -> dict[str, Any]:
    """Each wrong call raises the same TransferError on every rank and moves nothing; a good
    call after them still works (the ranks stay in step)."""
    from reshard_svc import Cat, TransferError, transfer

    trainer, inference = _mesh([0, 1, 2, 3]), _mesh([4, 5, 6, 7])
    src = _sources(trainer, lambda n: ["S(0)"])
    dst = _targets(inference)
    good = fused_names()
    a = "model.layers.0.self_attn."
    cases = {
        "missing": {k: v for k, v in good.items() if "gate_up" not in k},
        "unused": {**good, "lm_head.weight": "model.embed_tokens.weight"},
        "cat_length": {
            **good,
            a + "qkv_proj.weight": Cat((a + "q_proj.weight", a + "k_proj.weight")),
        },
        "shape": {**good, "lm_head.weight": "model.layers.0.self_attn.q_proj.weight"},
        "dtype": {**good, "model.norm.weight": "model.layers.0.self_attn.q_proj.weight"},
        "unknown_target": {**good, "no.such.weight": "lm_head.weight"},
    }
    out: dict[str, Any] = {}
    for case, names in cases.items():
        try:
            transfer(src, dst, names=names)
            out[case] = None
        except TransferError as e:
            out[case] = str(e)
    out["untouched_after_errors"] = len(_untouched(dst)) == (len(dst) if dst else 0)
    transfer(src, dst, names=good)
    out["wrong_after"] = _wrong(dst)
    return out


# ---------------------------------------------------------------- pipeline trainer, engines


def stage_of(name: str) -> int:
    """A 2-stage pipeline split: stage 0 holds the embeddings and layer 0, stage 1 the
    rest (each stage passes only its own keys)."""
    return 0 if "embed" in name or ".layers.0." in name else 1


def _pp_sources(scale: float = 1.0) -> dict[str, Any] | None:
    """2 stages x TP 2 on ranks 0-3: DTensors on each stage's own TP sub-mesh."""
    rank = dist.get_rank()
    if rank >= 4:
        _mesh([0, 1]), _mesh([2, 3])  # every rank builds every mesh
        return None
    meshes = [_mesh([0, 1]), _mesh([2, 3])]
    stage = rank // 2
    return {
        n: _dtensor(meshes[stage], tp_placements(n), full(n, scale))
        for n in trainer_params()
        if stage_of(n) == stage
    }


VOCAB_PAD = 64  # vLLM pads the vocabulary to a multiple of 64, then splits it over TP


def engine_shards(rank: int, tp: int = 4) -> dict[str, Any]:
    """A vLLM-like TP engine's own buffers, as LocalShards (filled in place): fused
    qkv_proj and gate_up_proj are one local tensor each (the LocalShards are views of
    them), the KV heads are replicated once TP exceeds their count (2 KV heads at TP 4:
    ranks 0-1 hold head 0), and the vocabulary is padded to 64 rows split 16 per rank
    (rank 2 holds 5 real rows, rank 3 none)."""
    from reshard_svc import LocalShard

    kv_heads, head_dim = 2, H // 4  # 4 query heads, 2 KV heads
    q_rows, kv_rows, ffn = H // tp, head_dim, INTER // tp
    kv_head = rank * kv_heads // tp
    out: dict[str, Any] = {}
    params = trainer_params()
    per = VOCAB_PAD // tp
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        buf = torch.full((per, H), SENTINEL, dtype=torch.bfloat16)
        valid = max(0, min(per, VOCAB - rank * per))
        out[name] = LocalShard(buf, (VOCAB, H), (rank * per, 0), valid=(valid, H))
    out["model.norm.weight"] = LocalShard(torch.full((H,), SENTINEL), (H,), (0,))
    for i in range(LAYERS):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = torch.full((q_rows + 2 * kv_rows, H), SENTINEL, dtype=torch.bfloat16)
        out[a + "q_proj.weight"] = LocalShard(qkv[:q_rows], (H, H), (rank * q_rows, 0))
        for j, k in enumerate(("k_proj", "v_proj")):
            at = q_rows + j * kv_rows
            out[a + k + ".weight"] = LocalShard(
                qkv[at : at + kv_rows], params[a + k + ".weight"][0], (kv_head * head_dim, 0)
            )
        gate_up = torch.full((2 * ffn, H), SENTINEL, dtype=torch.bfloat16)
        out[m + "gate_proj.weight"] = LocalShard(gate_up[:ffn], (INTER, H), (rank * ffn, 0))
        out[m + "up_proj.weight"] = LocalShard(gate_up[ffn:], (INTER, H), (rank * ffn, 0))
        o = torch.full((H, q_rows), SENTINEL, dtype=torch.bfloat16)
        out[a + "o_proj.weight"] = LocalShard(o, (H, H), (0, rank * q_rows))
        down = torch.full((H, ffn), SENTINEL, dtype=torch.bfloat16)
        out[m + "down_proj.weight"] = LocalShard(down, (H, INTER), (0, rank * ffn))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{norm}.weight"] = LocalShard(
                torch.full((H,), SENTINEL), (H,), (0,)
            )
    return out


def _engine_wrong(dst: dict[str, Any] | None, scale: float = 1.0) -> list[str]:
    """Names whose real rows differ from the trainer's tensor, or whose padding is not 0."""
    if dst is None:
        return []
    bad = []
    for name, shard in dst.items():
        want = full(name, scale)
        data = shard.data
        region = tuple(slice(o, o + n) for o, n in zip(shard.offsets, data.shape))
        ok = torch.equal(data, want[region]) if data.numel() else True
        ok = ok and all(bool((slab == 0).all()) for slab in shard.padding())
        if not ok:
            bad.append(name)
    return bad


def pp_to_inference() -> dict[str, Any]:
    """A 2-stage x TP 2 trainer (ranks 0-3, per-stage keys) into TP 4 DTensors (ranks 4-7),
    then into a vLLM-like engine of LocalShards, each with verify=True; then a second
    step from the cached plan."""
    from reshard_svc import transfer

    src = _pp_sources()
    inference = _mesh([4, 5, 6, 7])
    dst = _targets(inference, trainer_params())  # the trainer's names, unfused
    a = transfer(src, dst, verify=True)
    engine = engine_shards(dist.get_rank() - 4) if dist.get_rank() >= 4 else None
    b = transfer(src, engine, verify=True)
    if src is not None:
        for dt in src.values():
            dt.to_local().mul_(2)
    c = transfer(src, engine, verify=True)
    return {
        "dtensors": _summary(a),
        "wrong_dtensors": _wrong_unfused(dst),
        "engine": _summary(b),
        "engine_cached": _summary(c),
        "wrong_engine": _engine_wrong(engine, 2.0),
        "padding_rows": sum(s.tensor.numel() - s.data.numel() for s in (engine or {}).values()),
    }


def _wrong_unfused(dst: dict[str, Any] | None) -> list[str]:
    """Target names (the trainer's, unfused) whose shard differs from torch's own."""
    if dst is None:
        return []
    return [
        n
        for n, dt in dst.items()
        if not torch.equal(
            dt.to_local(), _dtensor(dt.device_mesh, tp_placements(n), full(n)).to_local()
        )
    ]


def verify_catches(case: str) -> dict[str, Any]:
    """verify=True refuses a piece that lands other than it was sent (a byte flipped on
    rank 5 while landing), and sources whose replicas differ; nothing is swapped in."""
    from reshard_svc import ReplicaMismatchError, TransferAbortedError, transfer
    from reshard_svc.runtime import transfer as runtime

    rank = dist.get_rank()
    if case == "landing":
        src = _sources(_mesh([0, 1, 2, 3]), lambda n: ["S(0)"])
    else:  # (dp 2 x tp 2): embeddings and norms have two replicas; one drifts on rank 3
        src = _sources(_mesh([0, 1, 2, 3], (2, 2)), fsdp_tp_placements)
        if src is not None and rank == 3:
            src["model.norm.weight"].to_local()[0] += 1
    dst = _targets(_mesh([4, 5, 6, 7]))
    real_take = runtime.Staging.take
    if case == "landing" and rank == 5:

        def take(self: Any, piece: Any, data: Any) -> bool:
            view = self.view(piece)
            view.copy_(data)
            view.view(-1)[0] += 1  # what arrives is not what was sent
            return True

        runtime.Staging.take = take  # type: ignore[method-assign]
    try:
        transfer(src, dst, names=fused_names(), verify=True, plan_cache=None)
        raised, message = None, ""
    except (TransferAbortedError, ReplicaMismatchError) as e:
        raised, message = type(e).__name__, str(e)
    finally:
        runtime.Staging.take = real_take  # type: ignore[method-assign]
    return {
        "raised": raised,
        "message": message,
        "untouched": _untouched(dst),
        "targets": len(dst or {}),
    }


def scenarios(names: list[str]) -> dict[str, Any]:
    """Run several scenarios in one 8-process world (process start-up dominates on CI)."""
    runs = {
        "fsdp_to_tp": fsdp_to_tp,
        "dp_tp_to_replicas": dp_tp_to_replicas,
        "overlapping": overlapping,
        "failure": lambda: failure_mid_transfer(5, 2),
        "mismatches": mismatches,
        "pp_to_inference": pp_to_inference,
        "verify_landing": lambda: verify_catches("landing"),
        "verify_replicas": lambda: verify_catches("replicas"),
    }
    return {name: runs[name]() for name in names}
