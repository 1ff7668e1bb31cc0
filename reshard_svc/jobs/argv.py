"""The worker's command line, both ways: what every launcher runs on every worker.

``python -m reshard_svc.worker convert SRC DST --flag value ...`` (after ``python``, or
after ``torchrun`` and its options); :func:`from_argv` reads it back
(``from_argv(to_argv(s), s.nodes, s.workers_per_node) == s``). Both are made from the
options :class:`~reshard_svc.jobs.spec.ConvertSpec` declares; ``nodes`` and
``workers_per_node`` are not on it: torchrun gives each worker its world.
"""

from __future__ import annotations

import argparse

from reshard_svc.jobs.spec import ConvertSpec, options, options_from_text

__all__ = ["WORKER_MODULE", "build_parser", "from_args", "from_argv", "to_argv", "worker_argv"]

#: The module every launcher runs on every worker (``python -m reshard_svc.worker``).
WORKER_MODULE = "reshard_svc.worker"


def worker_argv(spec: ConvertSpec, **options: str | None) -> list[str]:
    """``-m reshard_svc.worker convert SRC DST --flag value ...``: what every launcher
    runs on every worker (after ``python``, or after ``torchrun`` and its options).

    ``options`` are per-run extras such as ``progress_file``.
    """
    return ["-m", WORKER_MODULE, *to_argv(spec, **options)]


def to_argv(spec: ConvertSpec, **extras: str | None) -> list[str]:
    """``convert SRC DST --flag value ...``: the worker's arguments (see :func:`worker_argv`);
    ``extras`` are per-run options such as ``progress_file``."""
    argv = ["convert", spec.source, spec.target]
    for name, _, opt in options(placement=False):
        argv += opt.form.argv(opt.flag(name), getattr(spec, name))
    for key, value in extras.items():
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def from_argv(argv: list[str], nodes: int = 1, workers_per_node: int = 1) -> ConvertSpec:
    return from_args(build_parser().parse_args(argv), nodes, workers_per_node)


def from_args(args: argparse.Namespace, nodes: int = 1, workers_per_node: int = 1) -> ConvertSpec:
    values = options_from_text(vars(args), placement=False, files=False)
    if args.no_checksum:
        values["checksum"] = "none"
    return ConvertSpec(
        source=args.src,
        target=args.dst,
        nodes=nodes,
        workers_per_node=workers_per_node,
        extra={"progress_file": args.progress_file},
        **values,
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
    for name, default, opt in options(placement=False):
        opt.form.add_argument(c, opt.flag(name), default, opt.metavar, opt.flag_help())
    c.add_argument("--no-checksum", action="store_true", help=argparse.SUPPRESS)
    c.add_argument("--progress-file", help="rank 0 appends JSON progress lines here")
    return ap
