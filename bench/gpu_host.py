"""One GPU host, one prepared run: its floors, then ours against torch DCP tuned, on the
same bf16 state (8 GiB by default) held on the GPU. Written for a machine lent for a few
minutes (one call: ``python bench/gpu_host.py``, under 4 minutes on one H100/H200).

Floors, measured first: device -> pinned and pinned -> device copies; writing and reading
``--dir`` (tmpfs) with 1, 4 and 16 threads, each its own file; CRC32C over host memory
with 1, 4 and 16 threads; writing ``--disk`` with fsync (1 and 16 threads).

Then, each ``--runs`` times, the systems interleaved (medians reported):

* sync save to ``--dir``: ``reshard_svc.save`` (its default ``io_threads``) against
  ``dcp.save`` with ``FileSystemWriter(thread_count=16)``;
* load from ``--dir`` into GPU tensors: ``reshard_svc.load`` (every block checked) against
  ``dcp.load``;
* sync save to ``--disk``, fsynced: ours against ``dcp.save`` (16 threads);
* the training stall and the time to durable of a background save:
  ``CheckpointManager.save`` (stall: until it returns; commit: until ``wait`` returns) and
  in overlap mode (``optimizers=``: the stall is the save call plus the optimizer hook's
  wait after ``--compute`` seconds of forward/backward, kernels on the current stream)
  against ``dcp.async_save`` (with ``DefaultStager`` where torch has it; its stall ends
  when staging does: the optimizer must not step before).

``--device cpu`` runs the same cases on CPU tensors (no device copies): a smoke run on a
machine without a GPU. Prints one JSON object per measurement, then a summary with each
figure beside its floor and DCP's (``_over_floor``, ``_over_dcp``).

    python bench/gpu_host.py [--gib 8] [--runs 3] [--dir /dev/shm/reshard-gpu-bench]
                             [--disk /tmp/reshard-gpu-bench] [--device auto|cuda|cpu]
                             [--compute 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _threads(fn: Callable[[int], None], n: int) -> float:
    """Wall seconds of ``fn(i)`` on ``n`` threads at once."""
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    started = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - started


def _emit(**row: Any) -> dict[str, Any]:
    print(json.dumps({"bench": "gpu_host", **row}), flush=True)
    return row


def floors(args: argparse.Namespace, host: memoryview, state: dict[str, Any]) -> dict[str, float]:
    """GB/s of the host's floors (see the module doc)."""
    import crc32c
    import torch

    total = host.nbytes
    out: dict[str, float] = {}
    if args.device == "cuda":
        dev = torch.cat([v.view(torch.uint8) for v in state.values()])
        pinned = torch.empty(dev.numel(), dtype=torch.uint8, pin_memory=True)
        for name, dst, src in (("d2h_pinned", pinned, dev), ("h2d_pinned", dev, pinned)):
            torch.cuda.synchronize()
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            out[name] = total / (time.perf_counter() - started) / 1e9
        del dev, pinned
    piece = 4 << 20
    for n in (1, 4, 16):
        step = -(-total // n)

        def write(i: int, base: str = args.dir, sync: bool = False, step: int = step) -> None:
            a, b = i * step, min(total, (i + 1) * step)
            with open(os.path.join(base, f"floor-{i}"), "wb") as f:
                for at in range(a, b, piece):
                    f.write(host[at : min(b, at + piece)])
                if sync:
                    os.fsync(f.fileno())

        def read(i: int, step: int = step) -> None:
            a, b = i * step, min(total, (i + 1) * step)
            buf = bytearray(piece)
            with open(os.path.join(args.dir, f"floor-{i}"), "rb") as f:
                for at in range(a, b, piece):
                    f.readinto(memoryview(buf)[: min(piece, b - at)])

        def crc(i: int, step: int = step) -> None:
            a, b = i * step, min(total, (i + 1) * step)
            for at in range(a, b, piece):
                crc32c.crc32c(host[at : min(b, at + piece)])

        out[f"tmpfs_write_{n}t"] = total / _threads(write, n) / 1e9
        out[f"tmpfs_read_{n}t"] = total / _threads(read, n) / 1e9
        out[f"crc32c_{n}t"] = total / _threads(crc, n) / 1e9
        for i in range(n):
            os.remove(os.path.join(args.dir, f"floor-{i}"))
        if n in (1, 16):
            os.makedirs(args.disk, exist_ok=True)
            seconds = _threads(lambda i: write(i, args.disk, True), n)
            out[f"disk_fsync_write_{n}t"] = total / seconds / 1e9
            for i in range(n):
                os.remove(os.path.join(args.disk, f"floor-{i}"))
    for k, v in out.items():
        _emit(op="floor", what=k, gb_s=round(v, 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="state size (GiB of bf16)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm/reshard-gpu-bench", help="tmpfs folder")
    ap.add_argument("--disk", default="/tmp/reshard-gpu-bench", help="a local disk folder")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument(
        "--compute", type=float, default=0.5, help="seconds of forward/backward (overlap mode)"
    )
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    import reshard_svc
    from reshard_svc.plan.budget import io_threads

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    total = int(args.gib * (1 << 30)) // (1 << 20) * (1 << 20)
    count = 32
    g = torch.Generator(device=args.device).manual_seed(0)
    state = {
        f"layers.{i}.weight": torch.randn(total // count // 2, device=args.device, generator=g).to(
            torch.bfloat16
        )
        for i in range(count)
    }
    host = memoryview(torch.cat([v.view(torch.uint8).cpu() for v in state.values()]).numpy())
    for d in (args.dir, args.disk):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    _emit(op="setup", device=args.device, bytes=total, io_threads=io_threads(), runs=args.runs)
    floor = floors(args, host, state)
    del host

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    target = {k: torch.empty_like(v) for k, v in state.items()}
    ours_path, dcp_path = f"{args.dir}/ours", f"{args.dir}/dcp"

    def ours_to(path: str) -> None:  # on local disk: fsynced, durable when it returns
        reshard_svc.save(state, path)

    def dcp_to(path: str) -> None:  # FileSystemWriter fsyncs its files (sync_files=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=16))

    def ours_load() -> None:
        reshard_svc.load(target, ours_path)
        sync()

    def dcp_load() -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(dcp_path))
        sync()

    model = torch.nn.Linear(8, 8, device=args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # steps change nothing we save

    def compute(seconds: float) -> None:
        """The job's forward and backward between ``save`` and ``optimizer.step``: kernels
        on the current stream (the copies run beside them on the side stream)."""
        if args.device == "cuda":
            torch.cuda._sleep(int(seconds * 1.98e9))  # cycles at the H100/H200 boost clock
            torch.cuda.synchronize()
        else:
            time.sleep(seconds)

    def manager(overlap: bool, root: str, disk: bool = False) -> tuple[float, float]:
        """The training stall and the time to durable of one manager save. In overlap
        mode the stall is what the job loses: the save call, then (after ``--compute``
        seconds of forward/backward) the optimizer hook's wait for copies not yet done."""
        shutil.rmtree(root, ignore_errors=True)
        with reshard_svc.CheckpointManager(root, optimizers=[opt] if overlap else ()) as mgr:
            sync()
            started = time.perf_counter()
            mgr.save(1, state)
            stall = time.perf_counter() - started
            if overlap:
                compute(args.compute)
                opt.step()  # the hook: waits for the copies not yet done
                stall += mgr.last_wait_s
            mgr.wait()
            durable = time.perf_counter() - started
        shutil.rmtree(root, ignore_errors=True)  # tmpfs is memory: one copy at a time
        return stall, durable

    def dcp_async() -> tuple[float, float]:
        shutil.rmtree(f"{dcp_path}-async", ignore_errors=True)
        writer = dcp.FileSystemWriter(f"{dcp_path}-async", thread_count=16)
        kw: dict[str, Any] = {}
        if args.device == "cuda":  # staged to pinned memory in the background
            try:
                from torch.distributed.checkpoint.staging import DefaultStager

                kw["async_stager"] = DefaultStager()
            except ImportError:
                pass
        sync()
        started = time.perf_counter()
        response = dcp.async_save(state, storage_writer=writer, **kw)
        stall = time.perf_counter() - started
        future = getattr(response, "upload_completion", response)
        staged = getattr(response, "staging_completion", None)
        if staged is not None:
            staged.result()  # the optimizer must not step before: part of the stall
            stall = time.perf_counter() - started
        future.result()
        durable = time.perf_counter() - started
        shutil.rmtree(f"{dcp_path}-async", ignore_errors=True)
        return stall, durable

    timed: dict[str, list[float]] = {}

    def record(run: int, name: str, seconds: float) -> None:
        timed.setdefault(name, []).append(seconds)
        _emit(op=name, run=run, seconds=round(seconds, 4))  # each as it comes: a cut run keeps it

    for run in range(args.runs):
        saves = (("save_ours", ours_path, ours_to), ("save_dcp", dcp_path, dcp_to))
        for name, path, to in saves:
            shutil.rmtree(path, ignore_errors=True)  # freeing the last copy is not timed
            started = time.perf_counter()
            to(path)
            record(run, name, time.perf_counter() - started)
        for name, fn in (("load_ours", ours_load), ("load_dcp", dcp_load)):
            started = time.perf_counter()
            fn()
            record(run, name, time.perf_counter() - started)
        for name, path, to in saves:
            path = f"{args.disk}/{path.rsplit('/', 1)[1]}"
            shutil.rmtree(path, ignore_errors=True)
            started = time.perf_counter()
            to(path)
            record(run, f"disk_{name}", time.perf_counter() - started)
        for name, two in (
            ("manager", lambda: manager(False, f"{args.dir}/mgr")),
            ("overlap", lambda: manager(True, f"{args.dir}/mgr")),
            ("dcp_async", dcp_async),
        ):
            stall, durable = two()
            record(run, f"{name}_stall", stall)
            record(run, f"{name}_commit", durable)
    for name in ("ours", "dcp"):
        back = dict(target)
        (ours_load if name == "ours" else dcp_load)()
        if not all(
            torch.equal(back[k].view(torch.int16), v.view(torch.int16)) for k, v in state.items()
        ):
            sys.exit(f"{name}'s load is not bitwise")
    med = {k: statistics.median(v) for k, v in timed.items()}
    for k, v in timed.items():
        _emit(op=k, median_s=round(med[k], 4), all=[round(x, 4) for x in v])
    gbs = {k: total / v / 1e9 for k, v in med.items() if k.startswith(("save", "load", "disk"))}
    summary: dict[str, Any] = {"bench": "gpu_host", "device": args.device, "bytes": total}
    summary.update({f"{k}_gb_s": round(v, 2) for k, v in gbs.items()})
    summary["save_ours_over_dcp"] = round(gbs["save_ours"] / gbs["save_dcp"], 2)
    summary["load_ours_over_dcp"] = round(gbs["load_ours"] / gbs["load_dcp"], 2)
    summary["save_ours_over_floor"] = round(gbs["save_ours"] / floor["tmpfs_write_16t"], 2)
    summary["load_ours_over_floor"] = round(gbs["load_ours"] / floor["tmpfs_read_16t"], 2)
    summary["disk_save_ours_over_dcp"] = round(gbs["disk_save_ours"] / gbs["disk_save_dcp"], 2)
    summary["disk_save_ours_over_floor"] = round(
        gbs["disk_save_ours"] / floor["disk_fsync_write_16t"], 2
    )
    if "d2h_pinned" in floor:
        d2h = total / floor["d2h_pinned"] / 1e9
        summary["manager_stall_over_d2h_floor"] = round(med["manager_stall"] / d2h, 2)
    for k in ("manager_stall", "manager_commit", "overlap_stall", "overlap_commit",
              "dcp_async_stall", "dcp_async_commit"):  # fmt: skip
        summary[f"{k}_s"] = round(med[k], 4)
    print(json.dumps(summary), flush=True)
    for d in (args.dir, args.disk):
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
