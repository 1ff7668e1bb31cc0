"""The worker's command line, both ways: what every launcher runs on every worker.

``python -m reshard_svc.worker convert SRC DST --flag value ...`` (after ``python``, or
after ``torchrun`` and its options); :func:`from_argv` reads it back
(``from_argv(to_argv(s), s.nodes, s.workers_per_node) == s``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from reshard_svc.errors import UsageError
from reshard_svc.plan.spec import (
    CHECKSUMS,
    DEQUANTIZE,
    FORMATS,
    STRATEGIES,
    ConvertSpec,
    format_mesh,
    parse_mesh,
)

__all__ = ["WORKER_MODULE", "build_parser", "from_args", "from_argv", "to_argv", "worker_argv"]

#: The module every launcher runs on every worker (``python -m reshard_svc.worker``).
WORKER_MODULE = "reshard_svc.worker"


def worker_argv(spec: ConvertSpec, **options: str | None) -> list[str]:
    """``-m reshard_svc.worker convert SRC DST --flag value ...``: what every launcher
    runs on every worker (after ``python``, or after ``torchrun`` and its options).

    ``options`` are per-run extras such as ``progress_file``.
    """
    return ["-m", WORKER_MODULE, *to_argv(spec, **options)]


def to_argv(spec: ConvertSpec, **options: str | None) -> list[str]:
    """``convert SRC DST --flag value ...``: the worker's arguments (see
    :func:`worker_argv`)."""
    argv = [
        "convert",
        spec.source,
        spec.target,
        "--format",
        str(spec.format),
        "--strategy",
        str(spec.strategy),
        "--checksum",
        spec.checksum,
    ]
    if spec.mesh:
        argv += ["--mesh", format_mesh(spec.mesh)]
    if spec.rules:
        argv += ["--rules", json.dumps(spec.rules)]
    if spec.overwrite:
        argv.append("--overwrite")
    for glob in spec.only or ():
        argv += ["--only", glob]
    if spec.split_layers:
        argv.append("--split-layers")
    for rule in spec.rename or ():
        argv += ["--rename", rule]
    for glob in spec.keep_dtype or ():
        argv += ["--keep-dtype", glob]
    if not spec.copy_config:
        argv.append("--no-copy-config")
    for flag, value in (
        ("--dtype", spec.dtype),
        ("--dequantize", spec.dequantize),
        ("--max-memory", spec.max_memory),
        ("--max-shard-size", spec.max_shard_size),
        ("--strip-prefix", spec.strip_prefix),
        *((f"--{k.replace('_', '-')}", v) for k, v in options.items()),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def from_argv(argv: list[str], nodes: int = 1, workers_per_node: int = 1) -> ConvertSpec:
    args = build_parser().parse_args(argv)
    return from_args(args, nodes, workers_per_node)


def from_args(args: argparse.Namespace, nodes: int = 1, workers_per_node: int = 1) -> ConvertSpec:
    rules: Any = args.rules
    if rules is not None:
        stripped = rules.strip()
        if stripped.startswith(("{", "[")):
            try:
                rules = json.loads(stripped)
            except json.JSONDecodeError as e:
                raise UsageError(f"--rules is not valid JSON: {e}") from None
        from reshard_svc.errors import LayoutError
        from reshard_svc.plan.rules import load_rules

        try:
            rules = dict(load_rules(rules))
        except LayoutError as e:
            raise UsageError(str(e)) from None
    return ConvertSpec(
        source=args.src,
        target=args.dst,
        mesh=parse_mesh(args.mesh),
        rules=rules,
        format=args.format,
        dtype=args.dtype,
        strategy=args.strategy,
        checksum="none" if args.no_checksum else args.checksum,
        max_memory=args.max_memory,
        max_shard_size=args.max_shard_size,
        nodes=nodes,
        workers_per_node=workers_per_node,
        overwrite=args.overwrite,
        only=args.only,
        strip_prefix=args.strip_prefix,
        keep_dtype=args.keep_dtype,
        copy_config=not args.no_copy_config,
        rename=args.rename,
        split_layers=args.split_layers,
        dequantize=args.dequantize,
        extra={"progress_file": args.progress_file},
    ).checked()


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line (``python -m reshard_svc.worker convert ...``)."""
    ap = argparse.ArgumentParser(
        prog="python -m reshard_svc.worker",
        description="Run one conversion on this worker; start every worker with torchrun.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="convert SRC into DST")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--mesh", help="target mesh, e.g. tp=4 or dp=2,tp=4")
    c.add_argument("--rules", help="YAML/JSON file (or inline JSON): tensor glob -> placements")
    c.add_argument("--format", choices=FORMATS, default="native")
    c.add_argument("--dtype", help="cast floating-point tensors on the fly: bf16, fp16, fp32, fp64")
    c.add_argument(
        "--dequantize",
        choices=DEQUANTIZE,
        help="fp8-block: FP8 weights times their 128x128 block scales, cast to --dtype "
        "(default bf16); the scales are dropped",
    )
    c.add_argument("--strategy", choices=STRATEGIES, default="auto")
    c.add_argument("--max-memory", help="byte budget per worker, e.g. 1GiB")
    c.add_argument("--max-shard-size", help="HF export: cap per file, e.g. 5GB")
    c.add_argument(
        "--checksum",
        choices=CHECKSUMS,
        default="crc32c",
        help="what the output records: block CRC32Cs (default), plus sha256, or none",
    )
    c.add_argument("--no-checksum", action="store_true", help=argparse.SUPPRESS)
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a committed checkpoint at DST (other files there are kept)",
    )
    c.add_argument(
        "--only",
        action="append",
        metavar="GLOB",
        help="keep only tensors matching this glob (repeatable), e.g. 'model.*'",
    )
    c.add_argument(
        "--rename",
        action="append",
        metavar="FROM_GLOB=TO_PATTERN",
        help="rename tensors before --only/--strip-prefix (repeatable), e.g. "
        "'layers.*.wq.weight=model.layers.*.q_proj.weight'",
    )
    c.add_argument(
        "--split-layers",
        action="store_true",
        help="split stacked layers/experts axes (Megatron-Core) into per-layer names",
    )
    c.add_argument(
        "--strip-prefix", metavar="PREFIX", help="drop this prefix from tensor names, e.g. 'model.'"
    )
    c.add_argument(
        "--keep-dtype",
        action="append",
        metavar="GLOB",
        help="with --dtype: leave tensors matching this glob as they are (repeatable)",
    )
    c.add_argument(
        "--no-copy-config",
        action="store_true",
        help="--format hf: do not copy the source's config and tokenizer files",
    )
    c.add_argument("--progress-file", help="rank 0 appends JSON progress lines here")
    return ap
