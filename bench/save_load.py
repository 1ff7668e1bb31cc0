"""Save and load a Llama-shaped bf16 state dict (~2.7 GB) with reshard_svc and torch DCP.

Same run, interleaved, the order rotated each run: save at TP=4 on 4 gloo ranks (ours
with block CRC32Cs, the default; ours with ``checksum="none"``; ours with
``check_replicas=False``; ``dcp.save`` through our ``reshard_svc.dcp.Writer``, the
``dcp+ours`` variant; DCP FileSystemWriter), then load each checkpoint into TP=2 and into
Replicate on 2 ranks (ours verifies every block it reads; ``ours-none`` loads the
checksum-free copy, so nothing is verified; ``dcp+ours`` is ``dcp.load`` through our
``Reader``, DCP's planner over our format, every block checked). With ``--variants all`` also a save from a
(dp=2, tp=2) mesh, where every byte has two holders whose copies ``save`` compares
(``ours``) or not (``ours-unchecked``): the replica check's worst case. For
each: median wall time (max over ranks, between barriers), peak RSS per rank, and bytes
read from storage relative to the checkpoint (``rchar``, or reshard_svc's own count of
what it fetched, whichever is more).

    python bench/save_load.py [--size full|small] [--runs 3] [--dir /dev/shm/reshard-bench]

``--ops host`` is the host's own case: one rank, 2 GiB of CPU bf16 state (64 MiB with
``--size small``) saved to and loaded from ``--dir``, in this process, by ``save``/``load``
with the host's ``io_threads`` and with one thread, against the floor measured in the same
run: the same number of threads each writing (then reading) its share of the same bytes,
CRC32C-summing them in 1 MiB pieces.

Prints one JSON object per operation, then a summary object. The cost of checking is
given twice: the ratio of the medians, and the median of each run's ratio (``_paired``),
which a slow spell of the machine moves less.
"""

from __future__ import annotations

import argparse
import contextlib
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
    import reshard_svc.dcp

    common.import_reshard()
    dist.init_process_group("gloo")
    system, op = args.system, args.op
    path = os.path.join(args.dir, system)
    if op in ("save", "save2d"):
        sd = common.build(args.size, "tp" if op == "save" else "dp2tp", fill=True)
        path = os.path.join(args.dir, system if op == "save" else f"{system}-2d")
        if system.startswith("ours"):
            checksum = "none" if system == "ours-none" else "crc32c"
            check = system != "ours-unchecked"
            res = common.timed(
                lambda: reshard_svc.save(sd, path, checksum=checksum, check_replicas=check)
            )
            if op == "save2d" and system == "ours":
                res["replica_check_s"] = _replica_check_work(sd)
        elif system == "dcp+ours":
            res = common.timed(lambda: dcp.save(sd, storage_writer=reshard_svc.dcp.Writer(path)))
        else:
            res = common.timed(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(path)))
    else:
        sd = common.build(args.size, op, fill=False)
        if system in ("ours", "ours-none"):
            res = common.timed(lambda: reshard_svc.load(sd, path))
        elif system == "ours-direct":
            path = os.path.join(args.dir, "ours")
            res = common.timed(lambda: reshard_svc.load(sd, path, strategy="direct"))
        elif system == "dcp+ours":
            reader = reshard_svc.dcp.Reader(path)  # its bytes_read: what it fetched
            res = common.timed(lambda: (dcp.load(sd, storage_reader=reader), reader)[1])
        else:
            res = common.timed(lambda: dcp.load(sd, storage_reader=dcp.FileSystemReader(path)))
    res["rank"] = dist.get_rank()
    common.append_result(args.results, res)
    dist.destroy_process_group()


def _replica_check_work(sd: dict) -> float:
    """The replica check's own work, timed alone right after the save: this rank's CRC32C
    of every replicated box it holds (a writer hashes its boxes for the check on top of
    their block CRCs, every other holder hashes its copy), between barriers. Whole saves
    on this machine move by ±50 % from run to run (0.6-4 s for the same save), far more
    than the check costs, so the check is also measured on its own."""
    from reshard_svc.runtime.save import _describe_mine
    from reshard_svc.runtime.targets import replica_crcs

    placed, _ = _describe_mine(sd)
    boxes = {name: list(p.local) for name, p in placed.items()}  # dp=2: every byte twice
    return float(common.timed(lambda: replica_crcs(placed, boxes))["wall_s"])


def host_case(args: argparse.Namespace) -> None:
    """One rank's save and load of CPU state against the host's floor (see the module
    doc): JSON lines, medians of ``--runs``, the systems interleaved and rotated."""
    import crc32c
    import torch

    import reshard_svc
    from reshard_svc.plan.budget import io_threads

    total = (2 << 30) if args.size == "full" else (64 << 20)
    count = 16
    g = torch.Generator().manual_seed(0)
    state = {
        f"layers.{i}.weight": torch.randn(total // count // 2, generator=g).to(torch.bfloat16)
        for i in range(count)
    }
    target = {k: torch.empty_like(v) for k, v in state.items()}
    raw = memoryview(torch.cat([v.view(torch.uint8) for v in state.values()]).numpy())
    back = memoryview(bytearray(total))
    threads = io_threads()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "host")
    piece = 1 << 20

    def shares() -> list[tuple[int, int]]:
        step = -(-total // threads)
        return [(a, min(total, a + step)) for a in range(0, total, step)]

    def floor(write: bool) -> None:
        """Each thread writes (sums, then writes) or reads (reads, then sums) its share."""

        def one(i: int, a: int, b: int) -> None:
            with open(os.path.join(args.dir, f"floor-{i}"), "wb" if write else "rb") as f:
                for at in range(a, b, piece):
                    if write:
                        crc32c.crc32c(raw[at : min(b, at + piece)])
                        f.write(raw[at : min(b, at + piece)])
                    else:
                        f.readinto(back[at : min(b, at + piece)])
                        crc32c.crc32c(back[at : min(b, at + piece)])

        _in_threads(one, shares())

    def ours_save(n: int) -> None:
        reshard_svc.save(state, path, io_threads=n)

    def clear() -> None:  # before a timed save: what the last one wrote goes untimed
        shutil.rmtree(path, ignore_errors=True)
        for i in range(threads):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(args.dir, f"floor-{i}"))

    ops = {
        ("save", "floor"): lambda: floor(write=True),
        ("save", "ours"): lambda: ours_save(threads),
        ("save", "ours-1thread"): lambda: ours_save(1),
        ("load", "floor"): lambda: floor(write=False),
        ("load", "ours"): lambda: reshard_svc.load(target, path),
    }
    times: dict[tuple[str, str], list[float]] = {k: [] for k in ops}
    try:
        for run in range(args.runs):
            for op in ("save", "load"):
                for key in common.rotated(tuple(k for k in ops if k[0] == op), run):
                    if op == "save":
                        clear()
                    elif key == ("load", "ours") and not os.path.exists(path):
                        ours_save(threads)  # what the load reads: the default save
                    elif key == ("load", "floor") and not os.path.exists(f"{args.dir}/floor-0"):
                        floor(write=True)
                    started = time.perf_counter()
                    ops[key]()
                    times[key].append(time.perf_counter() - started)
        for k, v in target.items():
            if not torch.equal(v.view(torch.int16), state[k].view(torch.int16)):
                raise SystemExit(f"host case: {k} did not load back bitwise")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    summary: dict[str, object] = {
        "bench": "save_load",
        "op": "host",
        "bytes": total,
        "io_threads": threads,
        "runs": args.runs,
    }
    for (op, system), walls in times.items():
        wall = statistics.median(walls)
        print(
            json.dumps(
                {
                    "bench": "save_load",
                    "op": f"host {op} (1 rank, CPU state, {threads} I/O threads)",
                    "system": system,
                    "wall_s": round(wall, 3),
                    "gb_s": round(total / wall / 1e9, 2),
                    "wall_s_all": [round(w, 3) for w in walls],
                }
            )
        )
    for op in ("save", "load"):
        floor = statistics.median(times[(op, "floor")])
        summary[f"host_{op}_speed_over_floor"] = round(
            floor / statistics.median(times[(op, "ours")]), 2
        )
    summary["host_save_1thread_speed_over_floor"] = round(
        statistics.median(times[("save", "floor")])
        / statistics.median(times[("save", "ours-1thread")]),
        2,
    )
    print(json.dumps(summary))


def _in_threads(fn, ranges: list[tuple[int, int]]) -> None:
    """``fn(i, a, b)`` for each range on a thread of its own; the first error re-raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(ranges)) as pool:
        for f in [pool.submit(fn, i, a, b) for i, (a, b) in enumerate(ranges)]:
            f.result()


def variants(op: str, which: str) -> tuple[str, ...]:
    """The systems measured for ``op``: ``--variants all`` or just the defaults vs DCP."""
    if which == "defaults":
        return ("ours", "dcp+ours", "dcp")
    if op == "save":
        return ("ours", "ours-none", "ours-unchecked", "dcp+ours", "dcp")
    if op == "save2d":
        return ("ours", "ours-unchecked", "dcp")
    return ("ours", "ours-none", "ours-direct", "dcp+ours", "dcp")


def main() -> None:
    ap = common.bench_parser(__doc__, "/dev/shm/reshard-bench")
    ap.add_argument(
        "--system",
        choices=["ours", "ours-none", "ours-unchecked", "ours-direct", "dcp+ours", "dcp"],
        help=argparse.SUPPRESS,
    )
    ap.add_argument("--op", choices=["save", "save2d", "tp", "rep"], help=argparse.SUPPRESS)
    common.add_variants(
        ap, "ours (crc32c), ours-none, ours-unchecked, ours-direct, dcp+ours and dcp"
    )
    ap.add_argument(
        "--ops",
        help="comma-separated subset of save2d,save,tp,rep (loads need save); or host: one "
        "rank's save and load of CPU state against the host's floor",
    )
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.ops == "host":
        return host_case(args)

    os.makedirs(args.dir, exist_ok=True)
    results = os.path.join(args.dir, "results.jsonl")
    model = common.model_bytes(args.size)
    ops = [("save", 4), ("tp", 2), ("rep", 2)]
    if args.variants != "defaults":  # first, while the folder is empty: it needs the memory
        ops.insert(0, ("save2d", 4))
    if args.ops:
        ops = [(op, n) for op, n in ops if op in args.ops.split(",")]
    runs: dict[tuple[str, str], list] = {}
    try:
        for run in range(args.runs):
            for system in variants("save", args.variants):
                shutil.rmtree(os.path.join(args.dir, system), ignore_errors=True)
                shutil.rmtree(os.path.join(args.dir, f"{system}-2d"), ignore_errors=True)
            for op, n in ops:
                # interleaved, same conditions; rotated, so no variant always runs first
                for system in common.rotated(variants(op, args.variants), run):
                    per_rank = common.launch(
                        n,
                        __file__,
                        ["--size", args.size, "--dir", args.dir, "--system", system, "--op", op],
                        results,
                        attempts=2 if system == "dcp" else 1,
                        launcher=args.launcher,
                    )
                    runs.setdefault((system, op), []).append(per_rank)
                    # No load reads these: free their memory (tmpfs) before the next run.
                    unread = f"{system}-2d" if op == "save2d" else "ours-unchecked"
                    if op == "save2d" or system == unread:
                        shutil.rmtree(os.path.join(args.dir, unread), ignore_errors=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    names = {
        "save": "save TP=4 (4 ranks)",
        "save2d": "save (dp=2, tp=2): every byte on 2 ranks (4 ranks)",
        "tp": "load -> TP=2 (2 ranks)",
        "rep": "load -> Replicate (2 ranks)",
    }
    summary = {"bench": "save_load", "size": args.size, "model_bytes": model, "runs": args.runs}
    for op, _ in ops:
        ours = common.summarize(runs[("ours", op)], model)
        dcp = common.summarize(runs[("dcp", op)], model)
        rows = [("ours", ours), ("dcp", dcp)]
        if ("ours-none", op) in runs:
            none = common.summarize(runs[("ours-none", op)], model)
            rows.insert(1, ("ours-none", none))
            summary[f"{op}_wall_ratio_crc32c_over_none"] = round(ours["wall_s"] / none["wall_s"], 2)
            summary[f"{op}_wall_ratio_crc32c_over_none_paired"] = common.paired_ratio(
                runs[("ours", op)], runs[("ours-none", op)]
            )
        if ("ours-unchecked", op) in runs:
            unchecked = common.summarize(runs[("ours-unchecked", op)], model)
            rows.insert(1, ("ours-unchecked", unchecked))
            summary[f"{op}_wall_ratio_replicas_checked_over_unchecked"] = round(
                ours["wall_s"] / unchecked["wall_s"], 3
            )
            summary[f"{op}_wall_ratio_replicas_checked_over_unchecked_paired"] = (
                common.paired_ratio(runs[("ours", op)], runs[("ours-unchecked", op)])
            )
        if op == "save2d":
            check = statistics.median(
                max(r["replica_check_s"] for r in run) for run in runs[("ours", op)]
            )
            summary["save2d_replica_check_s"] = round(check, 3)
            summary["save2d_replica_check_over_unchecked_save"] = round(
                check / unchecked["wall_s"], 3
            )
        if ("dcp+ours", op) in runs:
            plugin = common.summarize(runs[("dcp+ours", op)], model)
            rows.insert(-1, ("dcp+ours", plugin))
            summary[f"{op}_wall_ratio_dcp+ours_over_dcp"] = round(
                plugin["wall_s"] / dcp["wall_s"], 2
            )
            summary[f"{op}_wall_ratio_dcp+ours_over_dcp_paired"] = common.paired_ratio(
                runs[("dcp+ours", op)], runs[("dcp", op)]
            )
        if ("ours-direct", op) in runs:
            direct = common.summarize(runs[("ours-direct", op)], model)
            rows.insert(-1, ("ours-direct", direct))
            summary[f"{op}_direct_wall_ratio_over_dcp"] = round(direct["wall_s"] / dcp["wall_s"], 2)
        for system, s in rows:
            print(json.dumps({"bench": "save_load", "op": names[op], "system": system, **s}))
        summary[f"{op}_wall_ratio_ours_over_dcp"] = round(ours["wall_s"] / dcp["wall_s"], 2)
        summary[f"{op}_rss_ratio_ours_over_dcp"] = round(
            ours["peak_rss_mb_per_rank"] / dcp["peak_rss_mb_per_rank"], 2
        )
    summary.update(common.checksum_speed())
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
