"""Live weight sync: reshard_svc.transfer against generation-1 gather-and-broadcast.

8 gloo ranks on one machine, the Llama-shaped bf16 model (~2.7 GB), two cases:
  * fsdp4_to_tp4: FSDP2 Shard(0) on ranks 0-3 -> TP 4 on ranks 4-7, with fused wqkv
    (= cat(wq, wk, wv)) and w13 (= cat(w1, w3)) on the inference side;
  * dp2xtp2_to_2xtp2: (dp 2 x tp 2) trainer on ranks 0-3 (FSDP2 x TP, embeddings and norms
    dp-replicated) -> two inference engines of TP 2 (ranks 4-5 and 6-7).
Generation 1 (OpenRLHF, slime, vLLM's nccl engine): per tensor, the trainer all-gathers it
with ``full_tensor()``, trainer rank 0 broadcasts it to every inference rank, and each
inference rank keeps its shard. Both run in the same processes, in alternating order, each
called twice (the second call is the steady state of an RL loop; ours then reuses its plan).
Reported per case, medians over runs of the max over ranks:
  * wall time of the steady call (and of our first call, planning included);
  * bytes sent by the busiest rank, measured (``wchar``: gloo writes to its sockets);
  * peak RSS growth of the busiest rank during the call (ours keeps one buffer of at most
    max_memory per rank with its cached plan: it grows on the first call, not the next);
  * whether both systems left bitwise-equal inference tensors.

    python bench/transfer.py [--size full|small] [--runs 3]

``--delta`` measures the RL loop instead (FSDP 4 -> TP 4 only): a
:class:`reshard_svc.WeightSync` session pushing after changes of 0.1 %, 1 %, 10 % and 100 %
of every tensor's elements (random elements, one bit each) and after a PULSE-like update
(``w += 3e-6 * sign(noise)`` in bf16: most updates are absorbed), against a full
``transfer()`` and generation-1 sync of the same weights, in the same processes. Reported
per push: wall time and bytes sent by the busiest rank (``wchar``, and the session's own
count), their ratios to the full transfer, and the sender's snapshot memory; at the end the
session's targets are compared bitwise with a full transfer's.

    python bench/transfer.py --delta [--size full|small] [--runs 3]

``--link RATE`` (root) runs the same between two emulated hosts: trainer ranks 0-3 in one
network namespace, inference ranks 4-7 in another, one torchrun node each, joined by a
veth pair that ``tc`` limits to RATE (``10gbit``, ``1gbit``) both ways (see
``bench/netlink.py``). Only trainer-to-engine traffic crosses it, as between hosts.

    sudo python bench/transfer.py --delta --link 10gbit [--size full|small] [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from netlink import EmulatedLink  # noqa: E402

CASES = ("fsdp4_to_tp4", "dp2xtp2_to_2xtp2")


def fused(size: str) -> dict[str, tuple[str, ...]]:
    """Inference name -> the trainer names it concatenates along dim 0."""
    out: dict[str, tuple[str, ...]] = {}
    for name in common.llama(size):
        if name.endswith("attention.wq.weight"):
            p = name.removesuffix("wq.weight")
            out[p + "wqkv.weight"] = (p + "wq.weight", p + "wk.weight", p + "wv.weight")
        elif name.endswith("feed_forward.w1.weight"):
            p = name.removesuffix("w1.weight")
            out[p + "w13.weight"] = (p + "w1.weight", p + "w3.weight")
    return out


def targets(size: str) -> dict[str, tuple[tuple[int, ...], str, tuple[str, ...]]]:
    """Inference name -> (shape, kind, sources)."""
    model = common.llama(size)
    out = {}
    merged = fused(size)
    used = {s for parts in merged.values() for s in parts}
    for name, parts in merged.items():
        rows = sum(model[s][0][0] for s in parts)
        out[name] = ((rows, model[parts[0]][0][1]), "col", parts)
    for name, (shape, kind) in model.items():
        if name not in used:
            out[name] = (shape, kind, (name,))
    return out


def trainer_placements(case: str, kind: str) -> list[str]:
    if case == "fsdp4_to_tp4":
        return ["S(0)"]
    if kind == "norm":
        return ["R", "R"]
    return ["SS(0,2)", "S(0)"] if kind == "col" else ["S(0)", "S(1)"]


def dtensor(mesh: Any, pls: list[str], shape: tuple[int, ...], fill: int | None) -> Any:
    """This rank's DTensor of a tensor on ``mesh``, built from its local shard alone."""
    import torch
    from torch.distributed.tensor import DTensor

    from reshard_svc.layout import Layout, parse_placements
    from reshard_svc.runtime import _compat

    placements = parse_placements(pls)
    layout = Layout(_compat.mesh_of(mesh), placements)
    me = _compat.mesh_rank_of(mesh)
    local_shape = layout.local_shape(shape, me)
    if fill is None:
        local = torch.zeros(local_shape, dtype=torch.bfloat16)
    else:
        # seeded by the shard, not the rank: replicas of a shard hold the same values
        first = layout.rank_boxes(shape, me)[0].offsets
        g = torch.Generator().manual_seed(fill * 1_000_003 + hash(first) % 1_000_003)
        local = torch.randn(local_shape, generator=g).to(torch.bfloat16)
    return DTensor.from_local(
        local,
        mesh,
        _compat.to_torch_placements(placements),
        run_check=False,
        shape=shape,
        stride=common._contiguous_stride(shape),
    )


class Setup:
    """The meshes and state dicts of one case on this rank (built on every rank)."""

    def __init__(self, size: str, case: str) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        import reshard_svc

        self.size, self.case = size, case
        self.rank = dist.get_rank()
        ranks = torch.arange(4)
        if case == "fsdp4_to_tp4":
            self.trainer = DeviceMesh("cpu", ranks)
            engines = [DeviceMesh("cpu", torch.arange(4, 8))]
        else:
            self.trainer = DeviceMesh("cpu", ranks.view(2, 2))
            engines = [
                DeviceMesh("cpu", torch.tensor([4, 5])),
                DeviceMesh("cpu", torch.tensor([6, 7])),
            ]
        mine = [m for m in engines if m.get_coordinate() is not None]
        self.engine = mine[0] if mine else None
        # gen-1's broadcast group: trainer rank 0 and every inference rank
        self.bcast = dist.new_group([0, 4, 5, 6, 7])
        self.cache = reshard_svc.PlanCache()  # its plan and buffer go when ours is done
        self.src: dict[str, Any] | None = None
        if self.trainer.get_coordinate() is not None:
            self.src = {
                name: dtensor(self.trainer, trainer_placements(case, kind), shape, fill=i)
                for i, (name, (shape, kind)) in enumerate(common.llama(size).items())
            }

    def fresh_targets(self) -> dict[str, Any] | None:
        if self.engine is None:
            return None
        return {
            name: dtensor(self.engine, common.placements(kind, "tp"), shape, fill=None)
            for name, (shape, kind, _) in targets(self.size).items()
        }


def ours(s: Setup, dst: dict[str, Any] | None) -> Any:
    import reshard_svc

    names = {t: reshard_svc.Cat(parts) for t, parts in fused(s.size).items()}
    return reshard_svc.transfer(s.src, dst, names=names, plan_cache=s.cache)


def gen1(s: Setup, dst: dict[str, Any] | None) -> None:
    """Gather each tensor on the trainer, broadcast it from trainer rank 0 to the inference
    ranks, keep the shard (how generation-1 RL stacks sync weights)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    model = common.llama(s.size)
    in_bcast = s.rank == 0 or s.engine is not None
    for name, (_, _, parts) in targets(s.size).items():
        pieces = []
        for part in parts:
            full = s.src[part].full_tensor() if s.src is not None else None
            if not in_bcast:
                continue
            if full is None:
                full = torch.empty(model[part][0], dtype=torch.bfloat16)
            dist.broadcast(full, src=0, group=s.bcast)
            pieces.append(full)
        if dst is not None:
            whole = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            t = dst[name]
            t.to_local().copy_(
                distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local()
            )


def measure(op: Any) -> dict[str, Any]:
    import torch.distributed as dist

    dist.barrier()
    base = common.reset_peak()
    w0, t0 = common.wchar(), time.perf_counter()
    op()
    dist.barrier()
    return {
        "wall_s": time.perf_counter() - t0,
        "sent": common.wchar() - w0,
        "rss_growth_mb": common.peak_rss_mb() - base,
    }


def run_case(size: str, case: str, order: int) -> dict[str, Any]:
    import torch

    s = Setup(size, case)
    out: dict[str, Any] = {"rank": s.rank, "case": case}
    results = {}
    for system in ("ours", "gen1") if order == 0 else ("gen1", "ours"):
        dst = s.fresh_targets()
        fn = ours if system == "ours" else gen1
        out[f"{system}_first"] = measure(lambda fn=fn, dst=dst: fn(s, dst))
        out[f"{system}_steady"] = measure(lambda fn=fn, dst=dst: fn(s, dst))
        results[system] = dst
        s.cache.clear()  # so the other system runs without our buffers
    out["bitwise_equal"] = s.engine is None or all(
        torch.equal(results["ours"][n].to_local(), results["gen1"][n].to_local())
        for n in results["ours"]
    )
    return out


#: (label, share of elements changed; None: the PULSE-like update)
PUSHES = (("0.1%", 0.001), ("1%", 0.01), ("10%", 0.1), ("100%", 1.0), ("pulse", None))


def change(src: dict[str, Any] | None, share: float | None, seed: int) -> float:
    """Change ``share`` of every local source tensor's elements in place (each a random
    element, its lowest bit flipped; 1.0: every element), or apply the PULSE-like update.
    Returns the share of elements that changed on this rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    changed = total = 0
    for dt in (src or {}).values():
        local = dt.to_local()
        ints = local.view(torch.int16).view(-1)
        n = ints.numel()
        total += n
        if share is None:  # w += lr * sign(noise), in bf16 (sign noise, lr 3e-6)
            before = ints.clone()
            step = torch.randint(0, 2, local.shape, generator=g, dtype=torch.int8) * 2 - 1
            local.copy_((local.float() + 3e-6 * step).to(local.dtype))
            changed += int((before != ints).sum())
        elif share >= 1.0:
            ints.bitwise_xor_(1)
            changed += n
        else:
            where = torch.randint(0, n, (int(n * share),), generator=g)
            ints[where] ^= 1
            changed += int(where.unique().numel())
    return changed / max(total, 1)


def run_delta(size: str, order: int) -> dict[str, Any]:
    """The RL loop on one rank: gen-1 and a full transfer, then a session's pushes."""
    import torch
    import torch.distributed as dist

    import reshard_svc

    s = Setup(size, "fsdp4_to_tp4")
    names = {t: reshard_svc.Cat(parts) for t, parts in fused(s.size).items()}
    out: dict[str, Any] = {"rank": s.rank, "case": "delta"}
    if order == 0:
        dst = s.fresh_targets()
        out["gen1"] = measure(lambda: gen1(s, dst))
        del dst
    full = s.fresh_targets()
    ours(s, full)
    out["full"] = measure(lambda: ours(s, full))
    s.cache.clear()
    dst = s.fresh_targets()
    sync = reshard_svc.WeightSync(s.src, dst, names=names)
    version = 1
    out["first_push"] = measure(lambda sync=sync: sync.push(version))
    for i, (label, share) in enumerate(PUSHES):
        out[f"share_{label}"] = change(s.src, share, seed=1000 * order + i)
        version += 1
        got: dict[str, Any] = {}
        out[label] = measure(
            lambda v=version, got=got, sync=sync: got.setdefault("r", sync.push(v))
        )
        out[label]["session_sent"] = got["r"].bytes_sent
    out["snapshot_mb"] = sync.snapshot_bytes / 1e6
    out["undo_mb"] = sync.undo_bytes / 1e6
    del sync  # its copies and journal buffers go before gen-1 gathers whole tensors
    gc.collect()
    if order == 1:
        out["gen1"] = measure(lambda: gen1(s, s.fresh_targets()))
    ours(s, full)  # the same weights, whole
    out["bitwise_equal"] = dst is None or all(
        torch.equal(dst[n].to_local().view(torch.int16), full[n].to_local().view(torch.int16))
        for n in dst
    )
    dist.barrier()
    return out


def delta_summary(args: argparse.Namespace, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    def med(key: str, field: str, scale: float = 1.0) -> float:
        return round(statistics.median(max(r[key][field] for r in run) for run in runs) / scale, 3)

    out: dict[str, Any] = {
        "bench": "transfer",
        "case": "delta, fsdp4_to_tp4",
        "link": args.link or "loopback",
        "size": args.size,
        "model_bytes": common.model_bytes(args.size),
        "ranks": 8,
        "runs": args.runs,
        "full_s": med("full", "wall_s"),
        "full_busiest_sent_mb": med("full", "sent", 1e6),
        "gen1_s": med("gen1", "wall_s"),
        "gen1_busiest_sent_mb": med("gen1", "sent", 1e6),
        "first_push_s": med("first_push", "wall_s"),
        "snapshot_mb_per_trainer_rank": round(
            statistics.median(max(r["snapshot_mb"] for r in run) for run in runs), 1
        ),
        "undo_mb_per_engine_rank": round(
            statistics.median(max(r["undo_mb"] for r in run) for run in runs), 1
        ),
    }
    for label, _ in PUSHES:
        wall, sent = med(label, "wall_s"), med(label, "sent", 1e6)
        out[label] = {
            "changed": round(
                statistics.median(max(r[f"share_{label}"] for r in run) for run in runs), 5
            ),
            "wall_s": wall,
            "busiest_sent_mb": sent,
            "session_busiest_sent_mb": med(label, "session_sent", 1e6),
            "wall_over_full": round(wall / out["full_s"], 3),
            "sent_over_full": round(sent / out["full_busiest_sent_mb"], 4),
            "wall_all": [round(max(r[label]["wall_s"] for r in run), 3) for run in runs],
        }
    out["gen1_over_ours_wall_at_1pct"] = round(out["gen1_s"] / out["1%"]["wall_s"], 2)
    out["bitwise_equal"] = all(r["bitwise_equal"] for run in runs for r in run)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_world_size() != 8:
        raise SystemExit("bench/transfer.py runs on 8 ranks")
    if args.delta:
        common.append_result(args.results, run_delta(args.size, args.order))
    else:
        for case in CASES:  # one launch for both cases: 8 processes take a while to start
            common.append_result(args.results, run_case(args.size, case, args.order))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(common.SIZES), default="full")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--delta", action="store_true", help="the RL loop: a WeightSync session")
    ap.add_argument(
        "--link",
        metavar="RATE",
        help="trainer and engine ranks on two emulated hosts joined at RATE (root; 10gbit)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    ap.add_argument("--order", type=int, default=0, help=argparse.SUPPRESS)
    common.add_launcher(ap)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="reshard-bench-transfer-") as tmp:
        results = os.path.join(tmp, "results.jsonl")
        extra = ["--delta"] if args.delta else []

        def argv(i: int) -> list[str]:
            return ["--size", args.size, "--order", str(i % 2), *extra]

        if args.link:
            with EmulatedLink(args.link) as link:
                runs = [link.launch(4, __file__, argv(i), results) for i in range(args.runs)]
        else:
            runs = [
                common.launch(8, __file__, argv(i), results, launcher=args.launcher)
                for i in range(args.runs)
            ]
    if args.delta:
        print(json.dumps(delta_summary(args, runs)))
        return
    for case in CASES:
        print(
            json.dumps(summary(args, case, [[r for r in run if r["case"] == case] for run in runs]))
        )


def summary(
    args: argparse.Namespace, case: str, runs: list[list[dict[str, Any]]]
) -> dict[str, Any]:
    def med(key: str, field: str, scale: float = 1.0) -> float:
        return round(statistics.median(max(r[key][field] for r in run) for run in runs) / scale, 3)

    out: dict[str, Any] = {
        "bench": "transfer",
        "case": case,
        "link": args.link or "loopback",
        "size": args.size,
        "model_bytes": common.model_bytes(args.size),
        "ranks": 8,
        "runs": args.runs,
        "ours_s": med("ours_steady", "wall_s"),
        "ours_first_call_s": med("ours_first", "wall_s"),
        "gen1_s": med("gen1_steady", "wall_s"),
        "ours_busiest_sent_mb": med("ours_steady", "sent", 1e6),
        "gen1_busiest_sent_mb": med("gen1_steady", "sent", 1e6),
        "ours_rss_growth_mb": med("ours_steady", "rss_growth_mb"),
        "ours_first_call_rss_growth_mb": med("ours_first", "rss_growth_mb"),
        "gen1_rss_growth_mb": med("gen1_steady", "rss_growth_mb"),
        "ours_s_all": [round(max(r["ours_steady"]["wall_s"] for r in run), 3) for run in runs],
        "gen1_s_all": [round(max(r["gen1_steady"]["wall_s"] for r in run), 3) for run in runs],
    }
    out["gen1_over_ours_wall"] = round(out["gen1_s"] / out["ours_s"], 2)
    out["gen1_over_ours_busiest_bytes"] = round(
        out["gen1_busiest_sent_mb"] / out["ours_busiest_sent_mb"], 2
    )
    out["bitwise_equal"] = all(r["bitwise_equal"] for run in runs for r in run)
    return out


if __name__ == "__main__":
    main()
