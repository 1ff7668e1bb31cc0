"""A training loop's checkpoints: how long each save stalls training, and how long until
it commits, CheckpointManager against torch DCP used the torchtitan way.

Same run, 4 gloo ranks, the Llama-shaped bf16 state dict (~2.7 GB) at TP=4, 12 steps (each
step writes every tensor, as an optimizer step does), a save every 3:
  * ours: ``CheckpointManager(interval=3, keep_last=2).save(step, sd)`` every step;
  * ours_defer: the same with ``if_busy="defer"``: a due save that finds the previous one
    in flight is put off to the next step instead of waiting (the cadence it achieves,
    steps between commits, is reported: P50 and P95);
  * dcp_async: ``dcp.async_save`` every 3rd step on its own gloo group, first waiting for
    the previous one (torchtitan's ``async_mode="async"``);
  * dcp_sync: ``dcp.save`` every 3rd step.
Per save: stall (the call's time, max over ranks), time until committed (call -> its
future done, max over ranks) and RSS after it. Medians over the saves of all runs; the
systems' order rotates from run to run.

    python bench/training_loop.py [--size full|small] [--runs 3] [--dir /dev/shm/reshard-bench-loop]
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

SYSTEMS = ("ours", "ours_defer", "dcp_async", "dcp_sync")
STEPS, EVERY = 12, 3


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import reshard_svc

    common.import_reshard()
    dist.init_process_group("gloo")
    sd = common.build(args.size, "tp", fill=True)
    tensors = [t._local_tensor if hasattr(t, "_local_tensor") else t for t in sd.values()]
    saves: list[dict] = []
    committed: dict[int, float] = {}

    def on_done(step: int, t0: float):
        return lambda _: committed.__setitem__(step, time.perf_counter() - t0)

    # torchtitan's async mode: DCP's background collectives on a gloo group of their own,
    # never on the one training uses (the loop's barriers would interleave with them)
    pg = dist.new_group(backend="gloo") if args.system == "dcp_async" else None
    mgr = None
    if args.system in ("ours", "ours_defer"):
        busy = "defer" if args.system == "ours_defer" else "wait"
        mgr = reshard_svc.CheckpointManager(
            f"{args.dir}/ours", interval=EVERY, keep_last=2, if_busy=busy
        )
    pending = None
    for step in range(1, STEPS + 1):
        with torch.no_grad():
            for t in tensors:
                t.add_(1)  # an optimizer step touches every byte (copy-on-write pages too)
        dist.barrier()
        t0 = time.perf_counter()
        due = False
        if mgr is not None:
            outcome = mgr.save(step, sd)
            saved = bool(outcome)
            due = saved or outcome.reason.startswith("deferred")
            pending_save = mgr._persistent._pending  # its commit (then retention)
            if saved and pending_save is not None:
                pending_save[1].add_done_callback(on_done(step, t0))
        elif step % EVERY == 0:
            saved = True
            uri = f"{args.dir}/{args.system}/step-{step}"
            if args.system == "dcp_async":
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(sd, checkpoint_id=uri, process_group=pg)
                pending.add_done_callback(on_done(step, t0))
            else:
                dcp.save(sd, checkpoint_id=uri)
                committed[step] = time.perf_counter() - t0
        else:
            saved = False
        stall = time.perf_counter() - t0
        if saved or due:  # a deferred call's stall counts too: it is what training waited
            saves.append(
                {"step": step, "stall_s": stall, "rss_mb": common.vm("VmRSS"), "saved": saved}
            )
            old = f"{args.dir}/{args.system}/step-{step - 3 * EVERY}"
            if mgr is None and dist.get_rank() == 0 and os.path.isdir(old):
                shutil.rmtree(old)  # keep the newest two committed, as ours (keep_last=2)
    if mgr is not None:
        mgr.close()
    elif pending is not None:
        pending.result()
    for s in saves:
        s["commit_s"] = committed.get(s["step"], float("nan"))
    common.append_result(args.results, {"rank": dist.get_rank(), "saves": saves})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = common.bench_parser(__doc__, "/dev/shm/reshard-bench-loop")
    ap.add_argument("--system", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    results = args.dir + "-results.jsonl"
    runs: dict[str, list] = {s: [] for s in SYSTEMS}
    try:
        for run in range(args.runs):
            for system in common.rotated(SYSTEMS, run):
                shutil.rmtree(args.dir, ignore_errors=True)
                os.makedirs(args.dir)
                runs[system].append(
                    common.launch(
                        4,
                        __file__,
                        ["--size", args.size, "--dir", args.dir, "--system", system],
                        results,
                        attempts=1 if system == "ours" else 2,
                        launcher=args.launcher,
                    )
                )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
        if os.path.exists(results):
            os.remove(results)

    def per_save(system: str, key: str) -> list[float]:
        """Each save's figure, max over ranks (saves in step order within each run)."""
        out = []
        for ranks in runs[system]:
            for i in range(len(ranks[0]["saves"])):
                out.append(max(r["saves"][i][key] for r in ranks))
        return out

    summary: dict = {
        "bench": "training_loop",
        "size": args.size,
        "ranks": 4,
        "runs": args.runs,
        "model_bytes": common.model_bytes(args.size),
        "steps": STEPS,
        "every": EVERY,
    }
    for system in SYSTEMS:
        stalls = per_save(system, "stall_s")
        commits = [c for c in per_save(system, "commit_s") if c == c]  # deferred: none
        rss = [
            [max(r["saves"][i]["rss_mb"] for r in ranks) for i in range(len(ranks[0]["saves"]))]
            for ranks in runs[system]
        ]
        summary[f"{system}_stall_s"] = round(statistics.median(stalls), 3)
        summary[f"{system}_stall_s_all"] = [round(x, 3) for x in stalls]
        summary[f"{system}_commit_s"] = round(statistics.median(commits), 3)
        summary[f"{system}_rss_mb_first_last"] = [round(rss[0][0]), round(rss[0][-1])]
    gaps = []
    for ranks in runs["ours_defer"]:
        steps = [s["step"] for s in ranks[0]["saves"] if s["saved"]]
        gaps += [b - a for a, b in zip(steps, steps[1:])]
    if gaps:
        gaps.sort()
        summary["ours_defer_steps_between_commits_p50"] = gaps[len(gaps) // 2]
        summary["ours_defer_steps_between_commits_p95"] = gaps[
            min(len(gaps) - 1, int(0.95 * len(gaps)))
        ]
    summary["ours_defer_stall_over_dcp_async"] = round(
        summary["ours_defer_stall_s"] / summary["dcp_async_stall_s"], 3
    )
    summary["ours_stall_over_dcp_async"] = round(
        summary["ours_stall_s"] / summary["dcp_async_stall_s"], 3
    )
    summary["ours_commit_over_dcp_async"] = round(
        summary["ours_commit_s"] / summary["dcp_async_commit_s"], 3
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
