"""Convert a Llama-shaped TP=4 bf16 checkpoint (~2.7 GB) to TP=2, TP=8 and one HF folder.

Same run, interleaved, fresh processes per operation:
  * ``cp -r`` of the source folder — the I/O floor;
  * reshard_svc convert TP=4 -> TP=2 (a merge; output checksums crc32c, the default, and
    sha256 and none), -> TP=8 (a split: 8 files from 2 workers) and -> HF, on 2 gloo
    workers; every source block read is checked against its CRC32C in all variants;
  * torch DCP written the way a user would: 2 ranks build the TP=2 model, ``dcp.load``
    the TP=4 DCP checkpoint, ``dcp.save`` it (and, for HF, save through
    ``HuggingFaceStorageWriter`` with consolidation).
Reports median wall time, peak RSS per worker, bytes read and written relative to the
checkpoint size.

    python bench/convert.py [--size full|small] [--runs 3] [--dir /dev/shm/reshard-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
    d = args.dir
    common.reset_peak()
    if args.op == "setup":  # TP=4 sources: ours and torch DCP's
        sd = common.build(args.size, "tp", fill=True)
        reshard_svc.save(sd, f"{d}/src")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{d}/src-dcp"))
        res = {"wall_s": 0.0}
    elif args.op == "ours-tp2":
        res = common.timed(
            lambda: reshard_svc.convert(
                f"{d}/src", f"{d}/out-ours-tp2", mesh="tp=2", max_memory=args.max_memory
            )
        )
    elif args.op in ("ours-tp2-sha256", "ours-tp2-none"):
        res = common.timed(
            lambda: reshard_svc.convert(
                f"{d}/src",
                f"{d}/out-ours-tp2",
                mesh="tp=2",
                max_memory=args.max_memory,
                checksum=args.op.rsplit("-", 1)[1],
            )
        )
    elif args.op == "ours-tp8":
        res = common.timed(
            lambda: reshard_svc.convert(
                f"{d}/src", f"{d}/out-ours-tp8", mesh="tp=8", max_memory=args.max_memory
            )
        )
    elif args.op == "ours-hf":
        res = common.timed(
            lambda: reshard_svc.convert(
                f"{d}/src", f"{d}/out-ours-hf", format="hf", max_memory=args.max_memory
            )
        )
    elif args.op == "dcp-tp2":

        def op() -> None:
            sd = common.build(args.size, "tp", fill=False)
            dcp.load(sd, storage_reader=dcp.FileSystemReader(f"{d}/src-dcp"))
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{d}/out-dcp-tp2"))

        res = common.timed(op)
    elif args.op == "dcp-hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        def op() -> None:
            sd = common.build(args.size, "tp", fill=False)
            dcp.load(sd, storage_reader=dcp.FileSystemReader(f"{d}/src-dcp"))
            writer = HuggingFaceStorageWriter(
                f"{d}/out-dcp-hf", save_distributed=True, enable_consolidation=True
            )
            dcp.save(sd, storage_writer=writer)

        res = common.timed(op)
    else:
        raise SystemExit(f"unknown op {args.op}")
    res["rank"] = dist.get_rank()
    common.append_result(args.results, res)
    dist.destroy_process_group()


def cp_floor(src: str, dst: str) -> dict:
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    return {
        "wall_s": time.perf_counter() - t0,
        "bytes_read": 0,
        "bytes_written": 0,
        "peak_rss_mb": 0,
    }


OPS = (
    "cp",
    "ours-tp2",
    "ours-tp2-sha256",
    "ours-tp2-none",
    "dcp-tp2",
    "ours-tp8",
    "ours-hf",
    "dcp-hf",
)
#: the other checksum settings, left out by ``--variants defaults``
VARIANTS = ("ours-tp2-sha256", "ours-tp2-none")


def main() -> None:
    ap = common.bench_parser(__doc__, "/dev/shm/reshard-bench-convert")
    ap.add_argument("--max-memory", default="1GiB")
    ap.add_argument("--op", help=argparse.SUPPRESS)
    common.add_variants(ap, "cp, ours (crc32c, sha256, none) and DCP, to TP=2 and HF")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    model = common.model_bytes(args.size)
    results = os.path.join(args.dir, "results.jsonl")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    base = ["--size", args.size, "--dir", args.dir, "--max-memory", args.max_memory]
    runs: dict[str, list] = {}
    ops = OPS if args.variants == "all" else tuple(op for op in OPS if op not in VARIANTS)
    try:
        common.launch(4, __file__, [*base, "--op", "setup"], results, launcher=args.launcher)
        for run in range(args.runs):
            # Rotate the order each run, so no operation always follows the same one.
            for op in common.rotated(ops, run):
                for name in os.listdir(args.dir):
                    if name.startswith("out-"):
                        shutil.rmtree(os.path.join(args.dir, name), ignore_errors=True)
                if op == "cp":
                    per_rank = [cp_floor(f"{args.dir}/src", f"{args.dir}/out-cp")]
                else:
                    per_rank = common.launch(
                        2,
                        __file__,
                        [*base, "--op", op],
                        results,
                        attempts=2 if op.startswith("dcp") else 1,
                        launcher=args.launcher,
                    )
                runs.setdefault(op, []).append(per_rank)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    summary = {
        "bench": "convert",
        "size": args.size,
        "model_bytes": model,
        "runs": args.runs,
        "max_memory": args.max_memory,
    }
    stats = {op: common.summarize(r, model) for op, r in runs.items()}
    for op, s in stats.items():
        print(json.dumps({"bench": "convert", "op": op, **s}))
    cp = stats["cp"]["wall_s"]
    summary["ours_tp2_over_cp"] = round(stats["ours-tp2"]["wall_s"] / cp, 2)
    for op in VARIANTS:
        if op in stats:
            summary[f"{op.replace('-', '_')}_over_cp"] = round(stats[op]["wall_s"] / cp, 2)
    summary["ours_tp8_over_cp"] = round(stats["ours-tp8"]["wall_s"] / cp, 2)
    summary["ours_hf_over_cp"] = round(stats["ours-hf"]["wall_s"] / cp, 2)
    summary["ours_tp2_over_dcp"] = round(
        stats["ours-tp2"]["wall_s"] / stats["dcp-tp2"]["wall_s"], 2
    )
    summary["ours_hf_over_dcp"] = round(stats["ours-hf"]["wall_s"] / stats["dcp-hf"]["wall_s"], 2)
    summary["rss_ours_tp2_mb"] = stats["ours-tp2"]["peak_rss_mb_per_rank"]
    summary["rss_dcp_tp2_mb"] = stats["dcp-tp2"]["peak_rss_mb_per_rank"]
    summary.update(common.checksum_speed())
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
