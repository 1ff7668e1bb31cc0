"""Shared pieces of the benchmarks: the Llama-shaped model, torchrun launching, stats.

Each measured operation runs in fresh torchrun processes (so peak RSS is per operation);
workers time the operation between barriers and append one JSON line to a results file.
``--launcher forkserver`` starts those workers through torch's elastic agent in the bench's
own process, forked from a server that imported torch and reshard_svc once: the same
workers and the same timed regions, started in a fraction of a second instead of several
(the smoke runs use it; the figures in docs/benchmarks.md come from ``torchrun``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

SIZES = {
    # The BASELINES.md model shape (wq/wk/wv all HxH here: 2.73 GB bf16).
    "full": {"layers": 24, "hidden": 2048, "ffn": 5632, "vocab": 32000},
    # The same widths with 2 layers (0.47 GB bf16): the fast tier's 1.4 GB with two moments.
    "medium": {"layers": 2, "hidden": 2048, "ffn": 5632, "vocab": 32000},
    # A quick smoke run of the same shape family.
    "small": {"layers": 2, "hidden": 256, "ffn": 704, "vocab": 4000},
}


def bench_parser(doc: str, default_dir: str) -> argparse.ArgumentParser:
    """The options every torchrun-launched bench shares (plus its hidden worker flags)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=default_dir, help="scratch folder (tmpfs by default)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    add_launcher(ap)
    return ap


def add_launcher(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="torchrun",
        help="torchrun: a `python -m torch.distributed.run` per operation, as a user runs "
        "it; forkserver: torch's elastic agent in this process, workers forked from a "
        "server with torch and reshard_svc imported (the same workers, quick to start)",
    )


def add_variants(ap: argparse.ArgumentParser, variants: str) -> None:
    """``--variants all|defaults``: every variant, or our defaults and the baselines only
    (a quicker run of the same code paths: the smoke runs use it)."""
    ap.add_argument(
        "--variants",
        choices=["all", "defaults"],
        default="all",
        help=f"all: {variants}; defaults: our default settings and the baselines only",
    )


def llama(size: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind); kind is col (TP Shard(0)), row (TP Shard(1)) or norm."""
    c = SIZES[size]
    h, f, v = c["hidden"], c["ffn"], c["vocab"]
    out: dict[str, tuple[tuple[int, ...], str]] = {"tok_embeddings.weight": ((v, h), "col")}
    for i in range(c["layers"]):
        p = f"layers.{i}."
        for n in ("wq", "wk", "wv"):
            out[p + f"attention.{n}.weight"] = ((h, h), "col")
        out[p + "attention.wo.weight"] = ((h, h), "row")
        out[p + "feed_forward.w1.weight"] = ((f, h), "col")
        out[p + "feed_forward.w3.weight"] = ((f, h), "col")
        out[p + "feed_forward.w2.weight"] = ((h, f), "row")
        out[p + "attention_norm.weight"] = ((h,), "norm")
        out[p + "ffn_norm.weight"] = ((h,), "norm")
    out["norm.weight"] = ((h,), "norm")
    out["output.weight"] = ((v, h), "col")
    return out


def model_bytes(size: str, itemsize: int = 2) -> int:
    import math

    return sum(math.prod(s) for s, _ in llama(size).values()) * itemsize


def placements(kind: str, target: str) -> list[str]:
    """Placements for a 1-D mesh: tp (TP layout), shard0 (all Shard(0)), rep (Replicate);
    dp2tp: a (dp=2, tp) mesh, replicated over dp, the TP layout over tp."""
    if target == "dp2tp":
        return ["R", *placements(kind, "tp")]
    if target == "rep" or kind == "norm":
        return ["R"]
    if target == "shard0":
        return ["S(0)"]
    return ["S(0)"] if kind == "col" else ["S(1)"]


def build(size: str, target: str, fill: bool) -> dict[str, Any]:
    """This rank's DTensors of the model on a 1-D mesh over the whole world (no full copy)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from reshard_svc.layout import Layout, Mesh, parse_placements
    from reshard_svc.runtime import _compat

    world, rank = dist.get_world_size(), dist.get_rank()
    dims = (2, world // 2) if target == "dp2tp" else (world,)
    mesh = init_device_mesh("cpu", dims)
    sd: dict[str, Any] = {}
    for name, (shape, kind) in llama(size).items():
        pls = parse_placements(placements(kind, target))
        layout = Layout(Mesh(dims), pls)
        local_shape = layout.local_shape(shape, rank)
        if fill:
            # Seeded by where the shard sits, so replicas (norms) hold the same bytes on
            # every rank, as in a real job (save compares them).
            box = layout.rank_boxes(shape, rank)[0]
            g = torch.Generator().manual_seed(zlib.crc32(repr((name, box.offsets)).encode()))
            local = torch.randn(local_shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
        else:
            local = torch.zeros(local_shape, dtype=torch.bfloat16)
        sd[name] = DTensor.from_local(
            local,
            mesh,
            _compat.to_torch_placements(pls),
            run_check=False,
            shape=shape,
            stride=_contiguous_stride(shape),
        )
    return sd


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _io(field: str) -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rchar() -> int:
    """Bytes this process read through read()/pread() so far (page-cache hits included)."""
    return _io("rchar")


def wchar() -> int:
    """Bytes this process wrote through write()/pwrite() so far."""
    return _io("wchar")


def reset_peak() -> float:
    """Reset the RSS high-water mark (VmHWM; ru_maxrss survives exec); return RSS in MB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return vm("VmRSS")


def vm(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    """Peak RSS of this process since exec (VmHWM), in MB."""
    return vm("VmHWM")


def import_reshard() -> None:
    """Import all of reshard_svc now, as ``import torch.distributed.checkpoint`` does for
    DCP: the package imports its modules on first use (so the CLI starts without torch),
    and a timed region should measure the operation, not that first import."""
    import reshard_svc

    for name in reshard_svc.__all__:
        getattr(reshard_svc, name)


def timed(op: Callable[[], Any]) -> dict[str, Any]:
    """Run ``op`` between barriers on every rank; wall time, bytes read, peak RSS.

    Bytes read are what the process read through read()/pread() (``rchar``), or, when
    ``op`` returns reshard_svc stats, what reshard_svc says it fetched, if more: it reads
    local files through memory maps, which ``rchar`` does not see, and it counts every
    whole CRC32C block it fetched (the over-read of checking blocks included).
    """
    import torch.distributed as dist

    dist.barrier()
    r0, w0, t0 = rchar(), wchar(), time.perf_counter()
    result = op()
    dist.barrier()
    wall = time.perf_counter() - t0
    read = rchar() - r0
    return {
        "wall_s": wall,
        "bytes_read": max(read, int(getattr(result, "bytes_read", 0))),
        "bytes_written": wchar() - w0,
        "peak_rss_mb": peak_rss_mb(),
    }


def checksum_speed(mib: int = 256) -> dict[str, float]:
    """CRC32C and sha256 throughput on one core, GB/s (median of 3 passes over ``mib``)."""
    import hashlib

    import numpy as np

    from reshard_svc.format.checksums import crc32c

    data = memoryview(np.random.default_rng(0).integers(0, 255, mib << 20, dtype=np.uint8))
    out = {}
    for name, fn in (
        ("crc32c_gb_s_per_core", lambda: crc32c(data)),
        ("sha256_gb_s_per_core", lambda: hashlib.sha256(data).digest()),
    ):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = round(data.nbytes / statistics.median(times) / 1e9, 2)
    return out


LAUNCHERS = ("torchrun", "forkserver")

#: torch and numpy: what any forkserver of workers imports once, before it forks one.
TORCH_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "numpy",
]
#: What the benches' forkserver imports (its environment is the bench's, set before it).
PRELOAD = [*TORCH_PRELOAD, "reshard_svc.runtime.convert", "reshard_svc.sessions"]
#: The variables torch's elastic agent sets for each worker (kept over the bench's env).
AGENT_KEYS = frozenset(
    "RANK LOCAL_RANK GROUP_RANK ROLE_RANK ROLE_NAME WORLD_SIZE LOCAL_WORLD_SIZE "
    "GROUP_WORLD_SIZE ROLE_WORLD_SIZE MASTER_ADDR MASTER_PORT".split()
)


def launch(
    nproc: int,
    script: str,
    args: list[str],
    results: str,
    attempts: int = 1,
    launcher: str = "torchrun",
) -> list[dict[str, Any]]:
    """``script --worker`` on ``nproc`` ranks (see :data:`LAUNCHERS`); returns the
    per-rank JSON lines.

    ``attempts`` > 1 is for torch's own baseline runs only (``dcp.async_save`` has been
    seen to SIGABRT on a loaded 2-core machine): a failed attempt is said on stderr, as
    JSON, and run again. Our own runs get one attempt, so a crash of ours fails the bench.
    """
    argv = ["--worker", "--results", results, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    for attempt in range(1, attempts + 1):
        if os.path.exists(results):
            os.remove(results)
        try:
            if launcher == "forkserver":
                _forkserver_launch(nproc, script, argv, env)
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
                cmd += [f"--nproc-per-node={nproc}", script, *argv]
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            break
        except (subprocess.CalledProcessError, WorkersFailed) as e:
            if attempt == attempts:
                raise
            note = {
                "warning": "baseline run failed; running it again",
                "exit": getattr(e, "returncode", str(e)),
                "script": os.path.basename(script),
                "args": args,
                "attempt": attempt,
            }
            print(json.dumps(note), file=sys.stderr)
    with open(results) as f:
        return [json.loads(line) for line in f]


class WorkersFailed(RuntimeError):
    """A forkserver launch whose workers did not all exit 0."""


def loopback_launch_config(nproc: int, start_method: str) -> Any:
    """torch's elastic ``LaunchConfig`` for ``nproc`` workers on this host: one node, a
    c10d rendezvous on a free loopback port, no restarts, a quick monitor. The bench's
    forkserver launcher and the test suite's harness start their workers with it."""
    import uuid

    from torch.distributed.launcher.api import LaunchConfig

    from reshard_svc._process import free_port

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=0,
        monitor_interval=0.05,
        start_method=start_method,
    )


def _forkserver_launch(nproc: int, script: str, argv: list[str], env: dict[str, str]) -> None:
    import multiprocessing

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    multiprocessing.set_forkserver_preload(PRELOAD)
    config = loopback_launch_config(nproc, "forkserver")
    bench_env = {k: v for k, v in env.items() if k not in AGENT_KEYS}
    try:
        elastic_launch(config, _forked_worker)(script, argv, bench_env)
    except ChildFailedError as e:
        raise WorkersFailed(f"{os.path.basename(script)} {' '.join(argv)}: {e}") from None


def _forked_worker(script: str, argv: list[str], env: dict[str, str]) -> None:
    """One rank, in a forked worker: the bench's environment and the agent's variables,
    the script run as ``script --worker ...`` (its output discarded, as torchrun's is)."""
    import runpy

    own = {k: v for k, v in os.environ.items() if k in AGENT_KEYS or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(own)
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def append_result(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def rotated(items: tuple[str, ...], run: int) -> tuple[str, ...]:
    """``items`` rotated by ``run``: so no variant always follows the same one."""
    k = run % len(items)
    return items[k:] + items[:k]


def paired_ratio(a: list[list[dict[str, Any]]], b: list[list[dict[str, Any]]]) -> float:
    """Median over runs of (wall of ``a`` / wall of ``b``) in the same run (max over ranks).

    Both variants ran back to back in each run, so a slow spell of the machine moves both:
    on a noisy 2-core VM this is steadier than the ratio of the two medians."""
    walls = [max(r["wall_s"] for r in ra) / max(r["wall_s"] for r in rb) for ra, rb in zip(a, b)]
    return round(statistics.median(walls), 3)


def summarize(runs: list[list[dict[str, Any]]], model: int) -> dict[str, Any]:
    """Medians over runs of: max wall over ranks, max peak RSS over ranks, bytes read sum."""
    walls = [max(r["wall_s"] for r in run) for run in runs]
    rss = [max(r["peak_rss_mb"] for r in run) for run in runs]
    reads = [sum(r["bytes_read"] for r in run) for run in runs]
    writes = [sum(r.get("bytes_written", 0) for r in run) for run in runs]
    return {
        "wall_s": round(statistics.median(walls), 3),
        "wall_s_all": [round(w, 3) for w in walls],
        "peak_rss_mb_per_rank": round(statistics.median(rss)),
        "bytes_read_rel": round(statistics.median(reads) / model, 2),
        "bytes_written_rel": round(statistics.median(writes) / model, 2),
    }
