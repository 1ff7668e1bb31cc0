"""torchrun entry point: ``torchrun --standalone --nproc-per-node N -m reshard_svc.worker convert SRC DST ...``

Every worker runs :func:`reshard_svc.convert`; the backend is NCCL when CUDA is available
and gloo otherwise (same code path). Rank 0 appends JSON lines to ``--progress-file``:
``{"event": "progress", ...}`` after every wave, then ``{"event": "done", ...}`` or
``{"event": "error", "error": "..."}``. The exit code is 0 only after the target is
committed. SIGTERM (what torchrun forwards on cancel) ends a worker before any commit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

__all__ = ["build_parser", "main"]

logger = logging.getLogger("reshard_svc.worker")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m reshard_svc.worker", description=__doc__.splitlines()[0]
    )
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="convert SRC into DST")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--mesh", help="target mesh, e.g. tp=4 or dp=2,tp=4")
    c.add_argument(
        "--rules", help="YAML/JSON file (or inline JSON) mapping tensor globs to placements"
    )
    c.add_argument("--format", choices=["native", "hf"], default="native")
    c.add_argument(
        "--dtype", help="cast floating-point tensors on the fly: bf16, fp16, fp32 or fp64"
    )
    c.add_argument("--strategy", choices=["auto", "exchange", "direct"], default="auto")
    c.add_argument("--max-memory", help="byte budget per worker, e.g. 1GiB")
    c.add_argument("--max-shard-size", help="HF export: cap per file, e.g. 5GB")
    c.add_argument("--progress-file", help="rank 0 appends JSON progress lines here")
    c.add_argument(
        "--checksum",
        choices=["crc32c", "sha256", "none"],
        default="crc32c",
        help="what the output records: block CRC32Cs (default), those plus sha256, or none",
    )
    c.add_argument("--no-checksum", action="store_true", help=argparse.SUPPRESS)
    return ap


def _rules(text: str | None) -> Any:
    if text is None:
        return None
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        return json.loads(stripped)
    return text


def _emit(path: str | None, record: dict[str, Any]) -> None:
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _die_with_parent() -> None:
    """Under the server, exit when torchrun (our parent) dies: no orphans, no late commit."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s"
    )
    import torch
    import torch.distributed as dist

    from reshard_svc.runtime.convert import convert

    if os.environ.get("RESHARD_JOB_ID") or os.environ.get("RESHARD_DIE_WITH_PARENT"):
        _die_with_parent()
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) >= 1
    if distributed and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    progress_file = args.progress_file if rank == 0 else None
    started = time.time()

    def progress(info: Any) -> None:
        _emit(progress_file, {"event": "progress", "time": time.time(), **info.to_json()})

    try:
        result = convert(
            args.src,
            args.dst,
            mesh=args.mesh,
            rules=_rules(args.rules),
            format=args.format,
            dtype=args.dtype,
            strategy=args.strategy,
            max_memory=args.max_memory,
            max_shard_size=args.max_shard_size,
            progress=progress,
            checksum="none" if args.no_checksum else args.checksum,
        )
    except Exception as e:
        _emit(progress_file, {"event": "error", "error": f"{type(e).__name__}: {e}"})
        logger.error("rank %d: convert failed: %s: %s", rank, type(e).__name__, e)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 1
    _emit(
        progress_file,
        {
            "event": "done",
            "strategy": result.strategy,
            "seconds": round(time.time() - started, 3),
            "bytes_read": result.bytes_read_total,
            "bytes_written": result.bytes_written_total,
            "bytes_exchanged": result.bytes_exchanged,
            "tensors": len(result.index.tensors),
        },
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
