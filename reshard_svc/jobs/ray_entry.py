"""A job's entrypoint on a Ray cluster: ``python -m reshard_svc.jobs.ray_entry --nodes N
--workers-per-node W -- <worker argv>`` (what ``RESHARD_LAUNCHER=ray`` submits through
Ray's job API).

It asks Ray for one bundle of ``W`` CPUs on each of ``N`` distinct nodes (a
``STRICT_SPREAD`` placement group), and while Ray cannot place it says so in the job's
log, in Ray's own words (``ray-entry: pending ...``; ``hopeless`` when the cluster has
fewer nodes than the job asks). Once placed it starts one task per bundle, each a torchrun
agent (``--nnodes N --node-rank i``, rendezvous at the first bundle's node), and exits
with the highest exit code of the agents. A torchrun agent dies with the Ray worker that
runs it, and the workers with their agent, so stopping the Ray job stops everything and
commits nothing. Ray is imported only here: an optional extra (``reshard-svc[ray]``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

__all__ = ["STATUS", "main"]

#: Lines the launcher reads back from the job's log.
STATUS = "ray-entry:"


def _say(*words: Any) -> None:
    sys.stdout.write(" ".join(map(str, (STATUS, *words))) + "\n")
    sys.stdout.flush()


def _agent_command(
    nodes: int, rank: int, per_node: int, addr: str, port: int, worker: list[str]
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--node-rank={rank}",
        f"--nproc-per-node={per_node}",
        f"--master-addr={addr}",
        f"--master-port={port}",
        *worker,
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reshard_svc.jobs.ray_entry")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--workers-per-node", type=int, required=True)
    ap.add_argument("--report-every", type=float, default=2.0)
    ap.add_argument("worker", nargs=argparse.REMAINDER, help="-- <worker argv>")
    args = ap.parse_args(argv)
    worker = args.worker[1:] if args.worker[:1] == ["--"] else args.worker

    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from reshard_svc._process import free_port, set_pdeathsig

    ray.init(address="auto", log_to_driver=True)
    n, per = args.nodes, args.workers_per_node
    pg = placement_group([{"CPU": float(per)}] * n, strategy="STRICT_SPREAD")
    while not ray.wait([pg.ready()], timeout=args.report_every)[0]:
        state = placement_group_table(pg)
        sched = (state.get("stats") or {}).get("scheduling_state", "")
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        why = f"Ray: placement group {state.get('state', '?')} ({sched or 'waiting'})"
        hopeless = alive < n or sched == "INFEASIBLE"
        if alive < n:
            why += f": {n} nodes of {per} CPUs asked, the cluster has {alive} nodes"
        _say("pending", "hopeless" if hopeless else "waiting", why)

    def on(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

    @ray.remote(num_cpus=0)
    def where() -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    @ray.remote
    def agent(cmd: list[str]) -> int:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # stdout and stderr go to this Ray worker's log, which Ray forwards to the job's
        return subprocess.call(cmd, env=env, preexec_fn=set_pdeathsig)  # noqa: PLW1509

    addr, port = ray.get(where.options(scheduling_strategy=on(0)).remote())
    _say("running", f"{n} torchrun nodes x {per} workers, rendezvous at {addr}:{port}")
    codes = ray.get(
        [
            agent.options(num_cpus=per, scheduling_strategy=on(i)).remote(
                _agent_command(n, i, per, addr, port, worker)
            )
            for i in range(n)
        ]
    )
    _say("done", "exit codes", codes)
    time.sleep(0.5)  # let Ray forward the agents' last lines
    return max(codes) if codes else 0


if __name__ == "__main__":
    sys.exit(main())
