"""One job, two engines: the same conversion through ``reshard-server`` on the local
launcher (``torchrun --standalone``, 2 workers) and on Slurm (2 nodes × 1 worker: two Slurm
tasks, each a torchrun agent, c10d rendezvous), interleaved, ``--runs`` times each.

Needs root and Debian's slurm-wlm + munge (a single-node cluster is started for the run,
as in the tests; both Slurm tasks share this host). Prints one JSON line per run, the
medians, and the log of the last Slurm job::

    python bench/launchers.py [--runs 3] [--dir /dev/shm/reshard-launchers]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cli_convert import build  # noqa: E402
from bench.slurm_cluster import SlurmCluster, missing  # noqa: E402
from reshard_svc._process import free_port  # noqa: E402

TOKEN = "bench-token"


def start_server(base: Path, port: int, **settings: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "RESHARD_TOKEN": TOKEN,
        "RESHARD_ROOTS": str(base),
        "RESHARD_DB": str(base / f"jobs-{port}.db"),
        "RESHARD_DATA_DIR": str(base / f"server-{port}"),
        "RESHARD_POLL_INTERVAL_S": "0.1",
        **{f"RESHARD_{k.upper()}": v for k, v in settings.items()},
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reshard_server.main",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
    )
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("server did not start")


def run_job(port: int, spec: dict) -> dict:
    from reshard_client import ReshardClient

    with ReshardClient(f"http://127.0.0.1:{port}", TOKEN) as c:
        t0 = time.perf_counter()
        job = c.submit(spec)
        done = c.wait(job.id, timeout=1800, poll=0.1)
        wall = time.perf_counter() - t0
        if done.state.value != "succeeded":
            raise RuntimeError(f"{done.error}\n{c.logs(job.id, tail=40).text}")
        logs = c.logs(job.id).text
    return {
        "submit_to_done_s": round(wall, 3),
        "running_s": round((done.finished_at - done.started_at).total_seconds(), 3),
        "bytes": done.progress.bytes_total,
        "log": logs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm/reshard-launchers")
    ap.add_argument("--size", default="1GiB", choices=["1GiB", "1MiB"])
    args = ap.parse_args()
    why = missing()
    if why:
        sys.exit(f"bench/launchers.py: {why}")
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    build(str(base / "src"), args.size)
    with SlurmCluster(base / "slurm") as cluster:
        os.environ["SLURM_CONF"] = str(cluster.conf)
        ports = {"local": free_port(), "slurm": free_port()}
        servers = [
            start_server(base, ports["local"]),
            start_server(
                base,
                ports["slurm"],
                launcher="slurm",
                slurm_extra_args="--nodes=1 --ntasks-per-node=2",
                slurm_log_dir=str(base / "slurm-logs"),
            ),
        ]
        walls: dict[str, list[float]] = {"local": [], "slurm": []}
        last_log = ""
        try:
            for i in range(args.runs):
                for engine in ("local", "slurm"):
                    dst = base / f"out-{engine}-{i}"
                    spec = {"source": str(base / "src"), "target": str(dst), "mesh": {"tp": 4}}
                    spec.update(
                        {"workers": 2} if engine == "local" else {"nodes": 2, "workers_per_node": 1}
                    )
                    r = run_job(ports[engine], spec)
                    walls[engine].append(r["submit_to_done_s"])
                    if engine == "slurm":
                        last_log = r.pop("log")
                    else:
                        r.pop("log")
                    print(json.dumps({"bench": "launchers", "engine": engine, "run": i, **r}))
                    shutil.rmtree(dst, ignore_errors=True)
        finally:
            for s in servers:
                s.terminate()
                s.wait(30)
    med = {k: round(statistics.median(v), 3) for k, v in walls.items()}
    print(
        json.dumps(
            {
                "bench": "launchers",
                "size": args.size,
                "runs": args.runs,
                "local_submit_to_done_s": med["local"],
                "slurm_2node_submit_to_done_s": med["slurm"],
                "slurm_over_local": round(med["slurm"] / med["local"], 2),
            }
        )
    )
    print("---- last Slurm job's log ----")
    print(last_log)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
