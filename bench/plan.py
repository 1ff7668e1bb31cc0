"""Plan a Llama-405B-shaped reshard, (dp=64, tp=8) -> (dp=32, tp=16), and time it.

Times the whole plan that ``load`` and ``convert`` compute for all 512 target ranks
(``read_plan.choose_plan``: every read with its file, byte range and reader, every piece
each rank sends and receives, the waves under the default 512 MiB budget), against torch
DCP's ``create_read_items_for_chunk_list`` on the same chunks in the same run. torch plans
one target rank at a time; we time a sample of ranks and extrapolate to all of them.

Also prints the plan's quality at 64 and 512 workers (max/mean bytes read and sent per
worker), planning time at three model sizes, and a repeated plan (served by the cache);
a replication sweep (one tensor of 2,048 stored chunks loaded ``Replicate`` by 256 …
4,096 ranks); and 1T-parameter MoEs saved on 2,048 ranks (dp=32 × ep=64) and loaded
on 4,096 (ep=256 × tp=16, norms and routers replicated): one Kimi-K2-shaped (61 layers,
384 experts, hidden 7168, attention as three dense projections), one of DeepSeek-V3's
shape (MLA's five projections and their norms, a dense first layer, separate
gate/up/down expert stacks, a shared expert, router score biases), and the first saved
as FSDP2 does by default (every non-expert parameter over the whole 2,048-rank world)
and loaded with attention row-parallel too; each against torch's per-rank planner in the
same run, with the peak RSS of this process.

    python bench/plan.py [--torch-ranks 4] [--layers 126] [--runs 3] [--moe-layers 61]

Prints JSON lines; the last one is the summary.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import time

import torch

from reshard_svc.format.index import CheckpointIndex, Chunk, TensorMeta
from reshard_svc.layout import Layout
from reshard_svc.plan.budget import Budget
from reshard_svc.plan.items import Held
from reshard_svc.plan.read import PLANS, StorageCost, choose_plan

LAYERS, H, F, V, KV = 126, 16384, 53248, 128256, 1024
BUDGET = Budget.of(None, "load")  # load's default max_memory
LOCAL = StorageCost(latency_s=5e-5, bandwidth=3e9, local=True)


def llama405b(layers: int = LAYERS) -> dict[str, tuple[tuple[int, ...], str]]:
    """fqn -> (shape, kind) with kind col (TP on dim 0), row (TP on dim 1) or norm."""
    tensors: dict[str, tuple[tuple[int, ...], str]] = {"tok_embeddings.weight": ((V, H), "col")}
    for i in range(layers):
        p = f"layers.{i}."
        tensors[p + "attention.wq.weight"] = ((H, H), "col")
        tensors[p + "attention.wk.weight"] = ((KV, H), "col")
        tensors[p + "attention.wv.weight"] = ((KV, H), "col")
        tensors[p + "attention.wo.weight"] = ((H, H), "row")
        tensors[p + "feed_forward.w1.weight"] = ((F, H), "col")
        tensors[p + "feed_forward.w3.weight"] = ((F, H), "col")
        tensors[p + "feed_forward.w2.weight"] = ((H, F), "row")
        tensors[p + "attention_norm.weight"] = ((H,), "norm")
        tensors[p + "ffn_norm.weight"] = ((H,), "norm")
    tensors["norm.weight"] = ((H,), "norm")
    tensors["output.weight"] = ((V, H), "col")
    return tensors


def layouts(dp: int, tp: int) -> dict[str, Layout]:
    """FSDP2 x TP placements as torchtitan produces them."""
    mesh = f"dp={dp},tp={tp}"
    return {
        "col": Layout.parse(mesh, f"SS(0,{tp}),S(0)"),
        "row": Layout.parse(mesh, "S(0),S(1)"),
        "norm": Layout.parse(mesh, "S(0),R"),
    }


def saved_index(model: dict, src: dict[str, Layout]) -> CheckpointIndex:
    """The index ``save`` writes at the source layout: one file per writer rank, bf16."""
    ends: dict[int, int] = {}
    tensors = {}
    for name, (shape, kind) in model.items():
        chunks = []
        for it in src[kind].write_items(shape, 2):
            f = f"shard-{it.writer:05d}.safetensors"
            begin = ends.get(it.writer, 0)
            ends[it.writer] = begin + it.box.numel * 2
            chunks.append(Chunk(box=it.box, file=f, begin=begin, end=ends[it.writer]))
        tensors[name] = TensorMeta(
            name=name, dtype=torch.bfloat16, shape=shape, layout=src[kind], chunks=tuple(chunks)
        )
    return CheckpointIndex(tensors=tensors, files={})


def wanted_at(model: dict, dst: dict[str, Layout]) -> dict:
    return {
        n: [Held(box=it.box, holders=it.holders) for it in dst[k].write_items(s, 2)]
        for n, (s, k) in model.items()
    }


def time_plan(
    index, wanted, world: int, strategy: str, runs: int, times: list[float] | None = None
) -> tuple[float, object]:
    """The median of ``runs`` plans, each from scratch (the cache cleared); every time is
    appended to ``times`` when given (the first one in a process included)."""
    times = [] if times is None else times
    plan = None
    for _ in range(runs):
        PLANS.clear()
        t0 = time.perf_counter()
        plan = choose_plan(index, wanted, world, BUDGET, strategy, LOCAL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), plan


def quality(plan) -> dict[str, float]:
    read, sent = plan.bytes_read(), plan.bytes_sent()
    mean_read, mean_sent = sum(read) / len(read), sum(sent) / len(sent)
    return {
        "read_max_over_mean": round(max(read) / mean_read, 3) if mean_read else 1.0,
        "sent_max_over_mean": round(max(sent) / mean_sent, 3) if mean_sent else 1.0,
    }


def torch_per_rank(index: CheckpointIndex, model: dict, dst: dict, world: int, ranks: int):
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    md = {
        k: TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.bfloat16),
            size=torch.Size(s),
            chunks=[
                ChunkStorageMetadata(torch.Size(c.box.offsets), torch.Size(c.box.sizes))
                for c in index.tensors[k].chunks
            ],
        )
        for k, (s, _) in model.items()
    }
    sample = list(range(0, world, max(1, world // ranks)))[:ranks]
    items = 0
    t0 = time.perf_counter()
    for rank in sample:
        for k, (s, kind) in model.items():
            local = [
                ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
                for b in dst[kind].rank_boxes(s, rank)
            ]
            items += len(create_read_items_for_chunk_list(k, md[k], local))
    return (time.perf_counter() - t0) / len(sample), len(sample), items


def rss_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def index_of(model: dict, src: dict[str, Layout], itemsize: int = 2) -> CheckpointIndex:
    """``saved_index`` for any model and layouts (kind -> layout)."""
    ends: dict[int, int] = {}
    tensors = {}
    for name, (shape, kind) in model.items():
        chunks = []
        for it in src[kind].write_items(shape, itemsize):
            f = f"shard-{it.writer:05d}.safetensors"
            begin = ends.get(it.writer, 0)
            ends[it.writer] = begin + it.box.numel * itemsize
            chunks.append(Chunk(box=it.box, file=f, begin=begin, end=ends[it.writer]))
        tensors[name] = TensorMeta(
            name=name, dtype=torch.bfloat16, shape=shape, layout=src[kind], chunks=tuple(chunks)
        )
    return CheckpointIndex(tensors=tensors, files={})


def replication_sweep(runs: int, torch_ranks: int) -> list[dict]:
    """One tensor stored as 2,048 FSDP chunks, loaded Replicate by N ranks."""
    rows = []
    model = {"norm": ((2048 * 4, 7168), "norm")}
    index = index_of(model, {"norm": Layout.parse("dp=2048", "S(0)")})
    for holders in (256, 512, 1024, 4096):
        dst = {"norm": Layout.parse(f"tp={holders}", "R")}
        wanted = wanted_at(model, dst)
        s, plan = time_plan(index, wanted, holders, "exchange", runs)
        per_rank, _, _ = torch_per_rank(index, model, dst, holders, torch_ranks)
        q = quality(plan)
        rows.append(
            {
                "holders": holders,
                "plan_s": round(s, 4),
                "torch_per_rank_s": round(per_rank, 4),
                **q,
                "rss_mb": rss_mb(),
            }
        )
    return rows


def moe_1t(layers: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Kimi-K2-shaped: 384 routed experts (w1, w3: [E, 2048, H]; w2: [E, H, 2048]), MLA-ish
    attention as dense projections, routers and norms (replicated when loaded)."""
    H, E, I, V = 7168, 384, 2048, 163840  # noqa: E741
    m: dict[str, tuple[tuple[int, ...], str]] = {"tok_embeddings.weight": ((V, H), "dense")}
    for i in range(layers):
        p = f"layers.{i}."
        m[p + "attention.wq.weight"] = ((H, H), "dense")
        m[p + "attention.wkv.weight"] = ((1024, H), "dense")
        m[p + "attention.wo.weight"] = ((H, H), "dense")
        m[p + "attention_norm.weight"] = ((H,), "norm")
        m[p + "ffn_norm.weight"] = ((H,), "norm")
        m[p + "moe.router.weight"] = ((E, H), "norm")
        m[p + "moe.experts.w1"] = ((E, I, H), "experts")
        m[p + "moe.experts.w3"] = ((E, I, H), "experts")
        m[p + "moe.experts.w2"] = ((E, H, I), "experts")
    m["norm.weight"] = ((H,), "norm")
    m["output.weight"] = ((V, H), "dense")
    return m


def moe_1t_mla(layers: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """A 1T MoE of another shape (DeepSeek-V3 / Kimi-K2 as Hugging Face names them): MLA
    attention (q_a/q_b/kv_a/kv_b/o projections of different sizes, their norms), a dense
    first layer, then per layer a router with its score bias, separate gate/up/down expert
    stacks ([E, I, H] / [E, H, I], 384 experts) and a shared expert."""
    H, E, I, DI, V = 7168, 384, 2048, 18432, 163840  # noqa: E741
    heads, q_rank, kv_rank, nope, rope, v_dim = 64, 1536, 512, 128, 64, 128
    m: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((V, H), "dense")}
    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        m[a + "q_a_proj.weight"] = ((q_rank, H), "dense")
        m[a + "q_a_layernorm.weight"] = ((q_rank,), "norm")
        m[a + "q_b_proj.weight"] = ((heads * (nope + rope), q_rank), "dense")
        m[a + "kv_a_proj_with_mqa.weight"] = ((kv_rank + rope, H), "dense")
        m[a + "kv_a_layernorm.weight"] = ((kv_rank,), "norm")
        m[a + "kv_b_proj.weight"] = ((heads * (nope + v_dim), kv_rank), "dense")
        m[a + "o_proj.weight"] = ((H, heads * v_dim), "dense")
        m[p + "input_layernorm.weight"] = ((H,), "norm")
        m[p + "post_attention_layernorm.weight"] = ((H,), "norm")
        if i == 0:  # the dense first layer
            m[p + "mlp.gate_proj.weight"] = ((DI, H), "dense")
            m[p + "mlp.up_proj.weight"] = ((DI, H), "dense")
            m[p + "mlp.down_proj.weight"] = ((H, DI), "dense")
            continue
        m[p + "mlp.gate.weight"] = ((E, H), "norm")
        m[p + "mlp.gate.e_score_correction_bias"] = ((E,), "norm")
        m[p + "mlp.experts.gate_proj"] = ((E, I, H), "experts")
        m[p + "mlp.experts.up_proj"] = ((E, I, H), "experts")
        m[p + "mlp.experts.down_proj"] = ((E, H, I), "experts")
        m[p + "mlp.shared_experts.gate_proj.weight"] = ((I, H), "dense")
        m[p + "mlp.shared_experts.up_proj.weight"] = ((I, H), "dense")
        m[p + "mlp.shared_experts.down_proj.weight"] = ((H, I), "dense")
    m["model.norm.weight"] = ((H,), "norm")
    m["lm_head.weight"] = ((V, H), "dense")
    return m


def moe_1t_rowwise(layers: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """:func:`moe_1t` with its attention output projection row-parallel when loaded (kind
    ``row``): every loaded box of it is a column slice of all rows."""
    return {
        n: (s, "row" if n.endswith("attention.wo.weight") else k)
        for n, (s, k) in moe_1t(layers).items()
    }


MOE_SHAPES = {"kimi-k2-ish": moe_1t, "mla": moe_1t_mla, "fsdp2-world": moe_1t_rowwise}


def moe_case(layers: int, torch_ranks: int, shape: str = "kimi-k2-ish", runs: int = 3) -> dict:
    """A 1T MoE planned for 4,096 ranks. ``fsdp2-world`` is saved as ``fully_shard`` does
    by default: every non-expert parameter, norms and routers included, ``S(0)`` over the
    whole 2,048-rank world (experts FSDP x EP as in the others), and loaded with attention
    column- *and* row-parallel: replicated targets fed by thousands of tiny chunks."""
    src = {
        k: Layout.parse("dp=32,ep=64", p)
        for k, p in (("dense", "S(0),S(0)"), ("norm", "S(0),S(0)"), ("experts", "S(1),S(0)"))
    }
    dst = {
        k: Layout.parse("ep=256,tp=16", p)
        for k, p in (("dense", "R,S(0)"), ("norm", "R,R"), ("experts", "S(0),S(1)"))
    }
    if shape == "fsdp2-world":
        for kind in ("dense", "norm", "row"):
            src[kind] = Layout.parse("dp=2048", "S(0)")
        dst["row"] = Layout.parse("ep=256,tp=16", "R,S(1)")
    model = MOE_SHAPES[shape](layers)
    index = index_of(model, src)
    params = sum(math.prod(s) for s, _ in model.values())
    t0 = time.perf_counter()
    wanted = wanted_at(model, dst)
    targets_s = time.perf_counter() - t0
    times: list[float] = []
    s, plan = time_plan(index, wanted, 4096, "exchange", runs, times)
    per_rank, timed, _ = torch_per_rank(index, model, dst, 4096, torch_ranks)
    return {
        "bench": "plan",
        "case": "1T MoE, dp=32 x ep=64 (2,048) -> ep=256 x tp=16 (4,096)"
        + (": FSDP2 over the world, attention row-parallel too" if shape == "fsdp2-world" else ""),
        "shape": shape,
        "layers": layers,
        "params": params,
        "source_chunks": sum(len(t.chunks) for t in index.tensors.values()),
        "templates": len({(s, k) for s, k in model.values()}),
        "targets_s": round(targets_s, 3),
        "plan_s": round(s, 3),  # the median of the runs
        "plan_s_all": [round(t, 3) for t in times],  # the first one in the process first
        "waves": len(plan.waves),
        "reads": plan.reads_count(),
        **quality(plan),
        "rss_mb": rss_mb(),
        "torch_ranks_timed": timed,
        "torch_per_rank_s": round(per_rank, 4),
    }


MOE_RULES = {"*.moe.experts.*": "S(0),S(1)", "*norm*": "R,R", "*.router.*": "R,R", "*": "R,S(0)"}


def reshard_plan_1t(layers: int) -> dict:
    """``reshard plan`` itself on the 1T MoE: its index and sparse data files of the sizes
    it names (a dry run reads only the index) in a temporary folder, sized for a load on
    ep=256 x tp=16."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from reshard_svc.format.index import FileMeta

    src = {
        k: Layout.parse("dp=32,ep=64", p)
        for k, p in (("dense", "S(0),S(0)"), ("norm", "S(0),S(0)"), ("experts", "S(1),S(0)"))
    }
    index = index_of(moe_1t(layers), src)
    ends: dict[str, int] = {}
    for t in index.tensors.values():
        for c in t.chunks:
            ends[c.file] = max(ends.get(c.file, 0), c.end)
    index = CheckpointIndex(tensors=index.tensors, files={f: FileMeta(n) for f, n in ends.items()})
    with tempfile.TemporaryDirectory() as tmp:
        for f, n in ends.items():  # sparse: the sizes the index names, no bytes on disk
            with open(Path(tmp, f), "wb") as fh:
                fh.truncate(n)
        Path(tmp, "reshard.index.json").write_bytes(index.dumps())
        cmd = [
            str(Path(sys.executable).with_name("reshard")),
            "plan",
            tmp,
            "--mesh",
            "ep=256,tp=16",
            "--rules",
            json.dumps(MOE_RULES),
            "--load",
            "--json",
        ]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"reshard plan failed: {out.stderr.strip()}")
        wall = time.perf_counter() - t0
    return {
        "bench": "plan",
        "case": "reshard plan --load, 1T MoE on ep=256 x tp=16",
        "layers": layers,
        "cli_wall_s": round(wall, 2),
        **json.loads(out.stdout),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-ranks", type=int, default=4, help="target ranks to time torch on")
    ap.add_argument("--layers", type=int, default=LAYERS, help="fewer for a smoke run")
    ap.add_argument("--runs", type=int, default=3, help="timed plans per case (median)")
    ap.add_argument("--moe-layers", type=int, default=61, help="layers of the 1T MoE case")
    args = ap.parse_args()
    for row in replication_sweep(args.runs, args.torch_ranks):
        print(json.dumps({"bench": "plan", "case": "replication sweep", **row}), flush=True)
    for shape in MOE_SHAPES:
        print(json.dumps(moe_case(args.moe_layers, args.torch_ranks, shape, args.runs)), flush=True)
    print(json.dumps(reshard_plan_1t(args.moe_layers)), flush=True)

    src = layouts(64, 8)
    model = llama405b(args.layers)
    index = saved_index(model, src)
    world = 32 * 16
    dst = layouts(32, 16)
    wanted = wanted_at(model, dst)
    chunks = sum(len(t.chunks) for t in index.tensors.values())

    ours, plan = time_plan(index, wanted, world, "auto", args.runs)
    t0 = time.perf_counter()
    again = choose_plan(index, wanted, world, BUDGET, "auto", LOCAL)
    cached_s = time.perf_counter() - t0
    if again is not plan:
        raise SystemExit("a repeated plan was not served from the cache")
    exch, plan_x = time_plan(index, wanted, world, "exchange", args.runs)

    rows = []
    for workers, (dp, tp) in ((64, (4, 16)), (512, (32, 16))):
        w = wanted_at(model, layouts(dp, tp))
        q = quality(choose_plan(index, w, workers, BUDGET, "exchange", LOCAL))
        rows.append(
            {
                "bench": "plan",
                "case": f"quality, exchange, {workers} workers",
                "target": f"dp={dp},tp={tp}",
                **q,
            }
        )
    scaling = []
    for layers in sorted({max(1, args.layers // 4), max(1, args.layers // 2), args.layers}):
        m = llama405b(layers)
        ix, wt = saved_index(m, src), wanted_at(m, dst)
        s, _ = time_plan(ix, wt, world, "auto", args.runs)
        n = sum(len(t.chunks) for t in ix.tensors.values())
        scaling.append(
            {
                "layers": layers,
                "source_chunks": n,
                "plan_s": round(s, 3),
                "us_per_chunk": round(s / n * 1e6, 2),
            }
        )
    per_rank, timed, items = torch_per_rank(index, model, dst, world, args.torch_ranks)
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({"bench": "plan", "case": "scaling (auto, 512 workers)", "sizes": scaling}))
    out = {
        "bench": "plan",
        "model": "llama-405b-shaped",
        "layers": args.layers,
        "source": "dp=64,tp=8",
        "target": "dp=32,tp=16",
        "tensors": len(model),
        "source_chunks": chunks,
        "runs": args.runs,
        "strategy_chosen": plan.strategy,
        "reads": plan.reads_count(),
        "waves": len(plan.waves),
        "ours_total_s": round(ours, 3),
        "ours_exchange_only_s": round(exch, 3),
        "ours_repeat_cached_s": round(cached_s, 4),
        "torch_ranks_timed": timed,
        "torch_read_items_on_timed_ranks": items,
        "torch_per_rank_s": round(per_rank, 4),
        "torch_all_ranks_extrapolated_s": round(per_rank * world, 2),
        "speedup_vs_torch_all_ranks": round(per_rank * world / ours, 1),
        **{f"exchange_{k}": v for k, v in quality(plan_x).items()},
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
