"""Checkpointing by MLPerf Storage's rules: ours and torch DCP in one run.

MLPerf Storage's checkpointing workload measures a save as written by every rank and made
durable, and a load read back cold, and defines the figures from the ranks' own clocks:
**duration = the slowest rank's**, **throughput = the slowest rank's** (its bytes over its
own time), repeated 5 times. This bench follows those rules on this machine:

* 8 gloo ranks save a Llama-shaped bf16 model with its AdamW state (two fp32 moments:
  5x the model's bytes), Shard(0) over all 8 (norms replicated), to a real disk
  (``--dir``, default under ``/tmp``), fsynced: ours (``reshard_svc.save``: block CRC32Cs, atomic commit, files and
  folders fsynced) and DCP (``FileSystemWriter``, ``sync_files=True``);
* the page cache of every file written is dropped (``posix_fadvise(DONTNEED)`` on each
  file: only these files, not the machine's cache), then the same 8 ranks load it back
  (ours checks every block's CRC32C; DCP checks nothing);
* beyond MLPerf: the same cold load at another world size (half the ranks, Shard(0)).

Each rank times its own operation (from a barrier to its own end); a rank's bytes are what
it wrote (``wchar``) or read (``rchar``, or reshard_svc's count of what it fetched through
memory maps, whichever is more). Medians over runs; the systems alternate.

    python bench/mlperf_checkpoint.py [--size medium|small|full] [--runs 5] [--ranks 8]
                                      [--dir /tmp/...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

SYSTEMS = ("ours", "dcp")


def state(size: str, fill: bool) -> dict[str, Any]:
    """The model and its two AdamW moments (fp32), Shard(0) over this world."""
    import torch

    model = common.build(size, "shard0", fill=fill)
    out: dict[str, Any] = {}
    for name, dt in model.items():
        out[f"model.{name}"] = dt
        for moment in ("exp_avg", "exp_avg_sq"):
            local = dt.to_local().float() * (0.5 if moment == "exp_avg" else 0.25)
            out[f"optim.{name}.{moment}"] = type(dt).from_local(
                local if fill else torch.zeros_like(local),
                dt.device_mesh,
                dt.placements,
                run_check=False,
                shape=dt.shape,
                stride=dt.stride(),
            )
    return out


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import reshard_svc

    common.import_reshard()
    dist.init_process_group("gloo")
    path = os.path.join(args.dir, args.system)
    sd = state(args.size, fill=args.op == "save")
    if args.op == "save":
        if args.system == "ours":
            op: Any = lambda: reshard_svc.save(sd, path)  # noqa: E731
        else:
            op = lambda: dcp.save(  # noqa: E731
                sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True)
            )
    elif args.system == "ours":
        op = lambda: reshard_svc.load(sd, path)  # noqa: E731
    else:
        op = lambda: dcp.load(sd, storage_reader=dcp.FileSystemReader(path))  # noqa: E731
    dist.barrier()
    r0, w0, t0 = common.rchar(), common.wchar(), time.perf_counter()
    result = op()
    own = time.perf_counter() - t0  # this rank's own duration, before waiting for others
    read = max(common.rchar() - r0, int(getattr(result, "bytes_read", 0) or 0))
    record = {
        "rank": dist.get_rank(),
        "seconds": own,
        "bytes": common.wchar() - w0 if args.op == "save" else read,
    }
    dist.barrier()
    common.append_result(args.results, record)
    dist.destroy_process_group()


def drop_cache(root: str) -> int:
    """Drop the page cache of every file under ``root`` (they are fsynced: clean pages)."""
    dropped = 0
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return dropped


def figures(ranks: list[dict[str, Any]]) -> dict[str, float]:
    duration = max(r["seconds"] for r in ranks)
    slowest = min(r["bytes"] / r["seconds"] for r in ranks if r["seconds"] > 0)
    total = sum(r["bytes"] for r in ranks)
    return {
        "duration_s": duration,
        "throughput_gb_s": slowest * len(ranks) / 1e9,  # the slowest rank's rate, times ranks
        "slowest_rank_gb_s": slowest / 1e9,
        "aggregate_gb_s": total / duration / 1e9,
        "bytes": total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(common.SIZES), default="medium")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/reshard-bench-mlperf", help="a real disk (fsynced)")
    ap.add_argument("--ranks", type=int, default=8, help="ranks saving (the other load: half)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--op", help=argparse.SUPPRESS)
    common.add_launcher(ap)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    world, other = args.ranks, max(1, args.ranks // 2)
    os.makedirs(args.dir, exist_ok=False)
    results = os.path.join(args.dir, "results.jsonl")
    got: dict[str, list[dict[str, float]]] = {}
    try:
        for run in range(args.runs):
            for system in common.rotated(SYSTEMS, run):
                shutil.rmtree(os.path.join(args.dir, system), ignore_errors=True)
                base = ["--size", args.size, "--dir", args.dir, "--system", system]
                for op, n in (("save", world), ("load", world), ("load", other)):
                    if op == "load":
                        drop_cache(os.path.join(args.dir, system))
                    ranks = common.launch(
                        n, __file__, [*base, "--op", op], results, launcher=args.launcher
                    )
                    key = f"{system}_{op}" + ("" if n == world else "_other_world")
                    got.setdefault(key, []).append(figures(ranks))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    out: dict[str, Any] = {
        "bench": "mlperf_checkpoint",
        "size": args.size,
        "state_bytes": common.model_bytes(args.size) * 5,
        "ranks": world,
        "other_world": other,
        "runs": args.runs,
        "rules": "duration = slowest rank; throughput = slowest rank's rate x ranks; "
        "fsynced saves; cold loads (page cache of the files dropped)",
    }
    for key, runs in got.items():
        out[key] = {
            name: round(statistics.median(r[name] for r in runs), 3)
            for name in ("duration_s", "throughput_gb_s", "slowest_rank_gb_s", "aggregate_gb_s")
        }
        out[key]["duration_all"] = [round(r["duration_s"], 3) for r in runs]
    for op in ("save", "load", "load_other_world"):
        ours, theirs = out.get(f"ours_{op}"), out.get(f"dcp_{op}")
        if ours and theirs:
            out[f"{op}_duration_over_dcp"] = round(ours["duration_s"] / theirs["duration_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
