"""Recovery after losing a node: the fast tier against the persistent root, one run.

4 gloo ranks as 2 simulated nodes × 2 (each node its own fast path under ``--dir``, a
tmpfs), a Llama-shaped bf16 model with AdamW-shaped moments (three copies of the model's
shapes, ~1.4 GB at ``--size medium``) at TP=4. Per run:

* (a) the stall a fast save adds to a step (``mgr.save`` with ``FastTier(every=1,
  copies=2)``; each save starts with none in flight) against ``dcp.async_save``'s stall
  on the same state (torchtitan's async mode), and the time until the fast step counts;
* (b) node 1 lost (its fast path removed), a new manager resumes the same step: from the
  fast tier, against ``reshard_svc.load`` of that step from the persistent root on local
  disk read cold (the files' page cache dropped with ``posix_fadvise(DONTNEED)``) and from
  moto S3 (a local server);
* (c) persistent bytes read ÷ the bytes the lost node held.

Prints one JSON line per run and a summary of medians, with the tmpfs used::

    python bench/recovery.py [--size medium|small] [--runs 3] [--dir /dev/shm/reshard-bench-recovery]
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

STEPS = 4
NODES = [0, 0, 1, 1]


def _state(size: str, fill: bool) -> dict:
    """The model and two moments (``exp_avg``, ``exp_avg_sq``), as DTensors at TP=4."""
    sd = {"model": common.build(size, "tp", fill)}
    sd["optim"] = {
        m: {k: v * 0.5 if fill else v.clone() for k, v in sd["model"].items()}
        for m in ("exp_avg", "exp_avg_sq")
    }
    return sd


def _locals(sd: dict) -> list:
    out = []
    for v in sd.values():
        out += _locals(v) if isinstance(v, dict) else [v._local_tensor]
    return out


def _drop_cache(folder: str) -> None:
    for dirpath, _, files in os.walk(folder):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import reshard_svc

    common.import_reshard()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    paths = [f"{args.dir}/node-{n}" for n in (0, 1)]
    tier = reshard_svc.FastTier(paths[NODES[rank]], every=1, copies=2, node=NODES[rank])
    root = f"{args.dir}-root"
    sd = _state(args.size, fill=True)
    tensors = _locals(sd)
    mine = sum(t.numel() * t.element_size() for t in tensors)
    out: dict = {"rank": rank, "node": NODES[rank], "bytes": mine}

    # (a) the stall of a fast save against dcp.async_save's
    mgr = reshard_svc.CheckpointManager(root, interval=10_000, fast=tier)
    stalls, commits = [], []
    for step in range(1, STEPS + 1):
        with torch.no_grad():
            for t in tensors:
                t.add_(1)
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(step, sd)
        stalls.append(time.perf_counter() - t0)
        mgr.wait()
        commits.append(time.perf_counter() - t0)
    out["fast_stall_s"], out["fast_commit_s"] = stalls, commits
    pg = dist.new_group(backend="gloo")
    dstalls = []
    for step in range(1, STEPS + 1):
        dist.barrier()
        t0 = time.perf_counter()
        pending = dcp.async_save(sd, checkpoint_id=f"{args.dir}-dcp/step-{step}", process_group=pg)
        dstalls.append(time.perf_counter() - t0)
        pending.result()
        if rank == 0:
            shutil.rmtree(f"{args.dir}-dcp/step-{step}", ignore_errors=True)
    out["dcp_async_stall_s"] = dstalls
    out["tmpfs_bytes"] = sum(
        os.path.getsize(os.path.join(d, f)) for p in paths for d, _, fs in os.walk(p) for f in fs
    )
    # the same step in the persistent root (local disk) and on S3
    mgr.save(STEPS, sd, force=True)
    mgr.wait()
    mgr.close()
    reshard_svc.save(sd, f"{args.s3}/step-{STEPS}")

    # (b) node 1 lost; resume from the fast tier, then from the root (cold) and from S3
    dist.barrier()
    if rank == 2:
        shutil.rmtree(paths[1])
    dist.barrier()
    got = _state(args.size, fill=False)
    with reshard_svc.CheckpointManager(root, fast=tier) as again:
        r = common.timed(lambda: again.load(got))
        info = again.last_restore
    out["fast"] = {**r, "step": info.step, "tier": info.tier, "phases": dict(info.phases)}
    out["bytes_local"], out["bytes_peer"] = info.bytes_local, info.bytes_peer
    out["bytes_persistent"] = info.bytes_persistent
    out["bitwise"] = all(torch.equal(a, b) for a, b in zip(_locals(got), tensors, strict=True))
    step_dir = f"{root}/step-{STEPS:010d}"
    if rank == 0:
        _drop_cache(step_dir)
    cold = _state(args.size, fill=False)
    out["disk_cold"] = common.timed(lambda: reshard_svc.load(cold, step_dir))
    s3 = _state(args.size, fill=False)
    out["s3"] = common.timed(lambda: reshard_svc.load(s3, f"{args.s3}/step-{STEPS}"))
    common.append_result(args.results, out)
    dist.barrier()
    dist.destroy_process_group()


def _moto() -> tuple[object, str]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    from reshard_svc._process import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    url = f"http://127.0.0.1:{port}"
    opts = {"endpoint_url": url, "key": "bench", "secret": "bench"}
    os.environ["FSSPEC_S3"] = json.dumps(opts)
    import s3fs

    s3fs.S3FileSystem(**opts).mkdir("bench")
    return server, "s3://bench"


def main() -> None:
    ap = common.bench_parser(__doc__, "/dev/shm/reshard-bench-recovery")
    ap.set_defaults(size="medium")
    ap.add_argument("--s3", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    results = args.dir + "-results.jsonl"
    server, bucket = _moto()
    lines = []
    try:
        for run in range(args.runs):
            for d in (args.dir, args.dir + "-root", args.dir + "-dcp"):
                shutil.rmtree(d, ignore_errors=True)
            ranks = common.launch(
                4,
                __file__,
                ["--size", args.size, "--dir", args.dir, "--s3", f"{bucket}/run-{run}"],
                results,
                launcher=args.launcher,
            )
            lines.append(_line(run, ranks))
            print(json.dumps(lines[-1]), flush=True)
    finally:
        for d in (args.dir, args.dir + "-root", args.dir + "-dcp"):
            shutil.rmtree(d, ignore_errors=True)
        if os.path.exists(results):
            os.remove(results)
        server.stop()  # type: ignore[attr-defined]

    def med(key: str) -> float:
        return round(statistics.median(x[key] for x in lines), 3)

    summary = {
        "bench": "recovery",
        "size": args.size,
        "runs": args.runs,
        "state_bytes": lines[0]["state_bytes"],
        "tmpfs_bytes": lines[0]["tmpfs_bytes"],
        **{
            k: med(k)
            for k, v in lines[0].items()
            if k.endswith(("_s", "_over")) and not isinstance(v, dict)
        },
        "restore_fast_phases_s": {
            k: round(statistics.median(x["restore_fast_phases_s"][k] for x in lines), 3)
            for k in lines[0]["restore_fast_phases_s"]
        },
        "persistent_bytes_per_lost_byte": med("persistent_bytes_per_lost_byte"),
        "bitwise": all(x["bitwise"] for x in lines),
    }
    print(json.dumps(summary))


def _line(run: int, ranks: list[dict]) -> dict:
    """One run's figures: each operation's wall is its slowest rank's (MLPerf's rule)."""

    def worst(key: str, i: int | None = None) -> float:
        if i is None:
            return max(r[key]["wall_s"] for r in ranks)
        return max(r[key][i] for r in ranks)

    fast_stall = statistics.median(worst("fast_stall_s", i) for i in range(STEPS))
    dcp_stall = statistics.median(worst("dcp_async_stall_s", i) for i in range(STEPS))
    lost = sum(r["bytes"] for r in ranks if r["node"] == 1)
    return {
        "bench": "recovery",
        "run": run,
        "state_bytes": sum(r["bytes"] for r in ranks),
        "tmpfs_bytes": max(r["tmpfs_bytes"] for r in ranks),
        "fast_save_stall_s": round(fast_stall, 3),
        "fast_step_counts_s": round(
            statistics.median(worst("fast_commit_s", i) for i in range(STEPS)), 3
        ),
        "dcp_async_stall_s": round(dcp_stall, 3),
        "stall_over": round(fast_stall / dcp_stall, 3),
        "restore_fast_s": round(worst("fast"), 3),
        "restore_disk_cold_s": round(worst("disk_cold"), 3),
        "restore_s3_s": round(worst("s3"), 3),
        "disk_over": round(worst("disk_cold") / worst("fast"), 2),
        "s3_over": round(worst("s3") / worst("fast"), 2),
        "persistent_bytes_per_lost_byte": sum(r["bytes_persistent"] for r in ranks) / lost,
        "restore_fast_phases_s": {
            k: round(max(r["fast"]["phases"].get(k, 0) for r in ranks), 3)
            for k in ("find", "check", "move")
        },
        "bytes_peer": sum(r["bytes_peer"] for r in ranks),
        "bitwise": all(r["bitwise"] for r in ranks),
    }


if __name__ == "__main__":
    main()
