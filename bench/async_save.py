"""Async save: how long training is blocked, and how long until the checkpoint commits.

Same run, 4 gloo ranks, the Llama-shaped bf16 state dict (~2.7 GB) at TP=4:
  * reshard_svc ``save`` (sync wall time);
  * reshard_svc ``async_save``: blocking time (call -> return) and total (call -> result);
  * torch ``dcp.async_save`` with ``FileSystemWriter``: the same two figures.
Each system saves twice in one process (first call: cold staging buffers; second call:
steady state, as in a training loop). Medians over runs of the max over ranks.

    python bench/async_save.py [--size full|small] [--runs 3] [--dir /dev/shm/reshard-bench-async]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import reshard_svc

    common.import_reshard()
    dist.init_process_group("gloo")
    sd = common.build(args.size, "tp", fill=True)
    d = args.dir
    res: dict = {"rank": dist.get_rank()}

    def clock(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    if args.system == "ours":
        _, res["sync_s"] = clock(lambda: reshard_svc.save(sd, f"{d}/ours-sync"))
        for i in (1, 2):
            t0 = time.perf_counter()
            fut, res[f"block{i}_s"] = clock(
                lambda i=i: reshard_svc.async_save(sd, f"{d}/ours-async{i}")
            )
            fut.result()
            res[f"total{i}_s"] = time.perf_counter() - t0
    else:
        for i in (1, 2):
            t0 = time.perf_counter()
            fut, res[f"block{i}_s"] = clock(
                lambda i=i: dcp.async_save(
                    sd, storage_writer=dcp.FileSystemWriter(f"{d}/dcp-async{i}")
                )
            )
            fut.result()
            res[f"total{i}_s"] = time.perf_counter() - t0
    dist.barrier()
    res["peak_rss_mb"] = common.peak_rss_mb()
    common.append_result(args.results, res)
    dist.destroy_process_group()


def main() -> None:
    ap = common.bench_parser(__doc__, "/dev/shm/reshard-bench-async")
    ap.add_argument("--system", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    results = os.path.join(args.dir + "-results.jsonl")
    runs: dict[str, list] = {"ours": [], "dcp": []}
    try:
        for _ in range(args.runs):
            for system in ("ours", "dcp"):
                shutil.rmtree(args.dir, ignore_errors=True)
                os.makedirs(args.dir)
                runs[system].append(
                    common.launch(
                        4,
                        __file__,
                        ["--size", args.size, "--dir", args.dir, "--system", system],
                        results,
                        attempts=2 if system == "dcp" else 1,
                        launcher=args.launcher,
                    )
                )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
        if os.path.exists(results):
            os.remove(results)

    def med(system: str, key: str) -> float:
        return round(statistics.median(max(r[key] for r in run) for run in runs[system]), 3)

    out = {
        "bench": "async_save",
        "size": args.size,
        "model_bytes": common.model_bytes(args.size),
        "ranks": 4,
        "runs": args.runs,
    }
    out["ours_sync_s"] = med("ours", "sync_s")
    for system in ("ours", "dcp"):
        for i in (1, 2):
            out[f"{system}_async_block{i}_s"] = med(system, f"block{i}_s")
            out[f"{system}_async_total{i}_s"] = med(system, f"total{i}_s")
        out[f"{system}_peak_rss_mb"] = round(
            statistics.median(max(r["peak_rss_mb"] for r in run) for run in runs[system])
        )
    out["ours_block_over_sync_first"] = round(out["ours_async_block1_s"] / out["ours_sync_s"], 3)
    out["ours_block_over_sync_steady"] = round(out["ours_async_block2_s"] / out["ours_sync_s"], 3)
    out["ours_block_over_dcp_block_first"] = round(
        out["ours_async_block1_s"] / out["dcp_async_block1_s"], 3
    )
    out["ours_block_over_dcp_block_steady"] = round(
        out["ours_async_block2_s"] / out["dcp_async_block2_s"], 3
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
