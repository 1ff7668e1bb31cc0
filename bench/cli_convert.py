"""The ``reshard convert`` command line, end to end: marginal cost per GiB against ``cp -r``.

A TP=2 bf16 checkpoint of 1 GiB and one of 1 MiB (Llama-shaped: column- and row-parallel
weights, ``--cases mixed``; or every weight split by columns, ``column``) are converted
to TP=4 by ``reshard convert SRC DST --mesh tp=4 --workers 2`` (a
fresh CLI process, torchrun, two gloo workers, every source block checked, block CRC32Cs
written) and copied with ``cp -r``, interleaved, ``--runs`` times each, in each folder
given (tmpfs and disk by default). The fixed costs (interpreter start, torchrun, process
groups) cancel out in the marginal cost::

    marginal = (convert 1 GiB - convert 1 MiB) / (cp 1 GiB - cp 1 MiB)     (medians)

``convert`` fsyncs every file it writes before it commits (the default), so it is held
against ``cp -r`` followed by ``sync`` of the copied files (the durable floor); ``convert``
with ``RESHARD_SYNC_FILES=0`` is held against plain ``cp -r``. On tmpfs a sync costs
nothing, so both pairs measure the same work there. A verified copy must bring every byte
through user space once (``cp -r`` may not: the kernel copies page to page), so the
floor of such a copy is measured too: ``cp -r`` then one CRC32C pass over every copied
file in 1 MiB blocks (``cp-crc``; ``cp-crc-sync`` syncs them after), and ``convert`` is
held against both.

    python bench/cli_convert.py [--size full|large|small] [--runs 3] [--cases mixed,column]
                                [--dirs /dev/shm/reshard-cli,/tmp/reshard-cli]

``--size large`` converts 3 GiB instead of 1 GiB: the CLI's fixed cost (4-6 s) varies by
more than 1 GiB costs, so the 1 GiB difference of medians is noisy at a few runs.

The fixed cost itself is measured first: a 6.5 MiB TP=2 checkpoint converted to TP=4 by
``--workers 1`` (the conversion runs in the CLI's own process) and by ``--workers 2``,
interleaved, ``--runs`` times each (at least 5); ``startup_ratio_w2_over_w1`` is the
ratio of their medians. ``--startup-only`` measures only that.
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

SIZES = {  # --size -> {label: (layers, hidden, ffn)}: the big and the tiny checkpoint (bf16)
    "full": {"1GiB": (8, 2048, 5632), "1MiB": (1, 256, 768)},
    # 4x the signal against the same fixed-cost noise (interpreter, torchrun, rendezvous)
    "large": {"3GiB": (32, 2048, 5632), "1MiB": (1, 256, 768)},
    "small": {"8MiB": (2, 512, 1408), "1MiB": (1, 256, 768)},  # a smoke run
}
STARTUP_SHAPE = (1, 512, 1536)  # 6.5 MiB


#: --cases -> each weight's placement on both sides (TP=2 saved, TP=4 wanted). ``mixed``:
#: Llama's tensor parallelism (column-parallel ``wqkv``/``w13`` split by rows, row-parallel
#: ``wo``/``w2`` split by columns: 31 % of the bytes); ``column``: every weight split by
#: columns (every output row a slice of a source row: the gather on every byte).
CASES = {
    "mixed": {"wqkv": "S(0)", "wo": "S(1)", "w13": "S(0)", "w2": "S(1)"},
    "column": {"wqkv": "S(1)", "wo": "S(1)", "w13": "S(1)", "w2": "S(1)"},
}


def build(path: str, shape: tuple[int, int, int], case: str = "mixed") -> int:
    """A TP=2 checkpoint at ``path`` (placements of ``CASES[case]``); returns its tensor
    bytes."""
    import torch

    import reshard_svc

    layers, h, f = shape
    g = torch.Generator().manual_seed(0)
    sd, rules = {}, {}
    split = CASES[case]
    for i in range(layers):
        for name, shape, pl in (
            ("wqkv", (3 * h, h), split["wqkv"]),
            ("wo", (h, h), split["wo"]),
            ("w13", (2 * f, h), split["w13"]),
            ("w2", (h, f), split["w2"]),
            ("norm", (h,), "R"),
        ):
            key = f"layers.{i}.{name}"
            sd[key] = torch.randn(shape, generator=g).to(torch.bfloat16)
            rules[key] = pl
    reshard_svc.save(sd, path + "-plain", checksum="none")
    reshard_svc.convert(path + "-plain", path, mesh="tp=2", rules=rules)
    shutil.rmtree(path + "-plain")
    return sum(t.numel() * t.element_size() for t in sd.values())


#: op -> (command kind, extra environment)
OPS = {
    "cp": ("cp", {}),
    "cp-sync": ("cp-sync", {}),
    "cp-crc": ("cp-crc", {}),
    "cp-crc-sync": ("cp-crc-sync", {}),
    "convert": ("convert", {}),
    "convert-nosync": ("convert", {"RESHARD_SYNC_FILES": "0"}),
}


def crc_files(folder: str) -> None:
    """One CRC32C pass over every file in ``folder``, in 1 MiB blocks (what a writer of
    our format sums), through a read-only map: the user-space pass a verified copy adds."""
    import mmap

    import crc32c

    block = 1024 * 1024
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        if not size:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            view = memoryview(m)
            for off in range(0, size, block):
                crc32c.crc32c(view[off : off + block])
            view.release()


def timed(cmd: list[str], extra_env: dict[str, str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING", **extra_env}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def bench_dir(base: str, runs: int, size: str = "full", case: str = "mixed") -> dict:
    shapes = SIZES[size]
    big, tiny = shapes
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    sizes = {s: build(f"{base}/src-{s}", shape, case) for s, shape in shapes.items()}
    os.sync()  # the sources' writeback must not land inside the timed runs
    walls: dict[str, list[float]] = {}
    cli = [sys.executable, "-m", "reshard_client.cli", "convert"]
    try:
        for _ in range(runs):
            for size in shapes:
                for op, (kind, extra_env) in OPS.items():
                    dst = f"{base}/out-{op}-{size}"
                    shutil.rmtree(dst, ignore_errors=True)
                    # no writeback left over from the previous run (an unsynced copy's)
                    os.sync()
                    src = f"{base}/src-{size}"
                    if kind == "cp":
                        cmd = ["cp", "-r", src, dst]
                    elif kind == "cp-sync":  # fsync every copied file and the folder
                        cmd = ["sh", "-c", 'cp -r "$1" "$2" && sync "$2"/* "$2"', "sh", src, dst]
                    elif kind.startswith("cp-crc"):
                        crc = f'"$3" {__file__} --crc-files "$2"'
                        then = ' && sync "$2"/* "$2"' if kind == "cp-crc-sync" else ""
                        script = f'cp -r "$1" "$2" && {crc}{then}'
                        cmd = ["sh", "-c", script, "sh", src, dst, sys.executable]
                    else:
                        cmd = [*cli, src, dst, "--mesh", "tp=4", "--workers", "2"]
                    walls.setdefault(f"{op}-{size}", []).append(timed(cmd, extra_env))
                    shutil.rmtree(dst, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in walls.items()}
    for k, v in walls.items():
        print(
            json.dumps(
                {
                    "bench": "cli_convert",
                    "dir": base,
                    "case": case,
                    "op": k,
                    "wall_s": round(med[k], 3),
                    "wall_s_all": [round(x, 3) for x in v],
                }
            )
        )
    gib = (sizes[big] - sizes[tiny]) / 2**30
    marginal = {op: (med[f"{op}-{big}"] - med[f"{op}-{tiny}"]) / gib for op in OPS}
    return {
        "bench": "cli_convert",
        "dir": base,
        "case": case,
        "runs": runs,
        **{f"marginal_{op.replace('-', '_')}_s_per_gib": round(v, 3) for op, v in marginal.items()},
        "marginal_ratio_convert_over_cp_sync": round(marginal["convert"] / marginal["cp-sync"], 2),
        "marginal_ratio_convert_nosync_over_cp": round(
            marginal["convert-nosync"] / marginal["cp"], 2
        ),
        # against the floor of a verified copy: cp -r plus one CRC32C pass
        "marginal_ratio_convert_over_cp_crc_sync": round(
            marginal["convert"] / marginal["cp-crc-sync"], 2
        ),
        "marginal_ratio_convert_nosync_over_cp_crc": round(
            marginal["convert-nosync"] / marginal["cp-crc"], 2
        ),
    }


def bench_startup(base: str, runs: int) -> dict:
    """The CLI's fixed cost: a 6.5 MiB conversion with 1 worker and with 2."""
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    src = f"{base}/src"
    size = build(src, STARTUP_SHAPE)
    os.sync()
    walls: dict[int, list[float]] = {1: [], 2: []}
    cli = [sys.executable, "-m", "reshard_client.cli", "convert"]
    try:
        for run in range(runs):
            for workers in (1, 2) if run % 2 == 0 else (2, 1):  # interleaved, rotated
                dst = f"{base}/out-w{workers}"
                shutil.rmtree(dst, ignore_errors=True)
                cmd = [*cli, src, dst, "--mesh", "tp=4", "--workers", str(workers)]
                walls[workers].append(timed(cmd, {}))
                shutil.rmtree(dst, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {w: statistics.median(v) for w, v in walls.items()}
    for w, v in walls.items():
        print(
            json.dumps(
                {
                    "bench": "cli_convert",
                    "dir": base,
                    "op": f"startup-workers{w}",
                    "bytes": size,
                    "wall_s": round(med[w], 3),
                    "wall_s_all": [round(x, 3) for x in v],
                }
            )
        )
    return {
        "bench": "cli_convert",
        "dir": base,
        "runs": runs,
        "startup_bytes": size,
        "startup_w1_s": round(med[1], 3),
        "startup_w2_s": round(med[2], 3),
        "startup_ratio_w2_over_w1": round(med[2] / med[1], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full", help="small: a smoke run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dirs", default="/dev/shm/reshard-cli,/tmp/reshard-cli")
    ap.add_argument("--startup-only", action="store_true", help="only the fixed cost")
    ap.add_argument("--cases", default="mixed,column", help=f"placements, of {', '.join(CASES)}")
    ap.add_argument("--crc-files", help=argparse.SUPPRESS)  # the cp-crc floor's CRC pass
    args = ap.parse_args()
    if args.crc_files:
        return crc_files(args.crc_files)
    dirs = args.dirs.split(",")
    startup_runs = args.runs if args.size == "small" else max(5, args.runs)
    print(json.dumps(bench_startup(dirs[0] + "-startup", startup_runs)))
    if args.startup_only:
        return
    for base in dirs:
        for case in args.cases.split(","):
            if case not in CASES:
                raise SystemExit(f"--cases: {case!r} is not one of {', '.join(CASES)}")
            print(json.dumps(bench_dir(base, args.runs, args.size, case)))


if __name__ == "__main__":
    main()
