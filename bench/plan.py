"""Plan a Llama-405B-shaped reshard, (dp=64, tp=8) -> (dp=32, tp=16), and time it.

Compares reshard_svc's global overlap planner (every target rank's pieces at once) with
torch DCP's ``create_read_items_for_chunk_list`` on the same chunks, in the same run.
torch plans one target rank at a time; we time a sample of ranks and extrapolate.

    python bench/plan.py [--torch-ranks 4] [--layers 126]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from reshard_svc.boxes import overlaps
from reshard_svc.layout import Layout

LAYERS, H, F, V, KV = 126, 16384, 53248, 128256, 1024


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-ranks", type=int, default=4, help="target ranks to time torch on")
    ap.add_argument("--layers", type=int, default=LAYERS, help="fewer for a smoke run")
    args = ap.parse_args()

    model = llama405b(args.layers)
    src_l, dst_l = layouts(64, 8), layouts(32, 16)

    t0 = time.perf_counter()
    src_chunks = {
        k: [it.box for it in src_l[kind].write_items(s)] for k, (s, kind) in model.items()
    }
    dst_chunks = {
        k: [it.box for it in dst_l[kind].write_items(s)] for k, (s, kind) in model.items()
    }
    t_chunks = time.perf_counter() - t0
    t1 = time.perf_counter()
    n_pieces = 0
    for k in model:
        n_pieces += len(overlaps(src_chunks[k], dst_chunks[k]))
    t_overlap = time.perf_counter() - t1

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
                ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
                for b in src_chunks[k]
            ],
        )
        for k, (s, _) in model.items()
    }
    world = 32 * 16
    sample = list(range(0, world, max(1, world // args.torch_ranks)))[: args.torch_ranks]
    torch_items = 0
    t2 = time.perf_counter()
    for rank in sample:
        for k, (s, kind) in model.items():
            local = [
                ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
                for b in dst_l[kind].rank_boxes(s, rank)
            ]
            torch_items += len(create_read_items_for_chunk_list(k, md[k], local))
    t_torch = time.perf_counter() - t2
    per_rank = t_torch / len(sample)

    out = {
        "bench": "plan",
        "model": "llama-405b-shaped",
        "layers": args.layers,
        "source": "dp=64,tp=8",
        "target": "dp=32,tp=16",
        "tensors": len(model),
        "source_chunks": sum(len(v) for v in src_chunks.values()),
        "target_chunks": sum(len(v) for v in dst_chunks.values()),
        "intersections": n_pieces,
        "ours_chunks_s": round(t_chunks, 3),
        "ours_overlap_s": round(t_overlap, 3),
        "ours_total_s": round(t_chunks + t_overlap, 3),
        "torch_ranks_timed": len(sample),
        "torch_read_items_on_timed_ranks": torch_items,
        "torch_per_rank_s": round(per_rank, 4),
        "torch_all_ranks_extrapolated_s": round(per_rank * world, 2),
        "speedup_vs_torch_all_ranks": round(per_rank * world / (t_chunks + t_overlap), 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
