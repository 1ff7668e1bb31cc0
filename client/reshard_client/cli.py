"""The ``reshard`` command line.

Local commands (``inspect``, ``verify``) call reshard_svc directly. Exit codes: 0 ok,
1 the checkpoint has problems (verify), 2 bad input or an error reading it.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

app = typer.Typer(
    name="reshard",
    help="Inspect, verify and reshard PyTorch distributed checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def _fail(e: Exception, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {type(e).__name__}: {e}", highlight=False)
    return typer.Exit(code)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


@app.command()
def inspect(
    uri: Annotated[str, typer.Argument(help="Checkpoint folder: path, file://, s3://, memory://")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the full description as JSON.")
    ] = False,
) -> None:
    """Show a checkpoint's tensors: dtype, shape, layout, chunks and bytes."""
    from reshard_svc import ReshardError
    from reshard_svc import inspect as do_inspect
    from reshard_svc.inspection import describe_index

    try:
        index = do_inspect(uri)
    except ReshardError as e:
        raise _fail(e) from None
    if as_json:
        sys.stdout.write(json.dumps(describe_index(index, uri), indent=1) + "\n")
        return
    table = Table(title=f"{uri}  ({index.source})", title_justify="left")
    for col in ("tensor", "dtype", "shape", "layout", "chunks", "bytes"):
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left")
    for name, t in sorted(index.tensors.items()):
        table.add_row(
            name,
            str(t.dtype).removeprefix("torch."),
            "x".join(map(str, t.shape)) or "scalar",
            str(t.layout) if t.layout else "-",
            str(len(t.chunks)),
            _size(t.nbytes),
        )
    out.print(table)
    out.print(
        f"{len(index.tensors)} tensors, {_size(index.total_bytes)} in {len(index.files)} files"
        + (f"; extras: {', '.join(sorted(index.extras))}" if index.extras else "")
    )


@app.command()
def verify(
    uri: Annotated[str, typer.Argument(help="Checkpoint folder to check end to end.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check coverage, overlaps, byte ranges, file sizes, headers and sha256. Exit 1 on problems."""
    from reshard_svc import verify as do_verify

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=as_json or not err.is_terminal,
    )
    with bar:
        task = bar.add_task("verifying", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        try:
            report = do_verify(uri, progress=progress)
        except Exception as e:  # storage failures outside the report
            raise _fail(e) from None
    if as_json:
        sys.stdout.write(json.dumps(report.to_json(), indent=1) + "\n")
    elif report.ok:
        out.print(
            f"[green]ok[/] {uri}: {report.tensors} tensors, {report.files_checked} files, "
            f"{_size(report.bytes_hashed)} hashed",
            highlight=False,
        )
    else:
        for p in report.problems:
            err.print(f"[red]problem:[/] {p}", highlight=False)
        err.print(f"{len(report.problems)} problem(s) in {uri}", highlight=False)
    raise typer.Exit(0 if report.ok else 1)


def _bar(disable: bool = False) -> Progress:
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        "{task.fields[tensors]}",
        TimeRemainingColumn(),
        console=err,
        transient=False,
        disable=disable or not err.is_terminal,
    )


@app.command()
def convert(
    src: Annotated[
        str, typer.Argument(help="Source checkpoint (native, DCP HF, plain HF, DCP .distcp).")
    ],
    dst: Annotated[str, typer.Argument(help="Target folder (must be new or a checkpoint).")],
    mesh: Annotated[str | None, typer.Option(help="Target mesh, e.g. tp=4 or dp=2,tp=4.")] = None,
    rules: Annotated[
        str | None, typer.Option(help="YAML/JSON file mapping tensor-name globs to placements.")
    ] = None,
    format: Annotated[
        str, typer.Option(help="native, or hf for one consolidated HF folder.")
    ] = "native",
    dtype: Annotated[str | None, typer.Option(help="Cast on the fly: bf16, fp16 or fp32.")] = None,
    strategy: Annotated[str, typer.Option(help="auto, exchange or direct.")] = "auto",
    max_memory: Annotated[str, typer.Option(help="Byte budget per worker, e.g. 1GiB.")] = "1GiB",
    max_shard_size: Annotated[str, typer.Option(help="HF export: cap per file.")] = "5GB",
    workers: Annotated[
        int, typer.Option(min=1, help="torchrun workers to launch (1 runs in-process).")
    ] = 1,
    checksum: Annotated[
        bool, typer.Option(help="sha256 every output file (--no-checksum is faster).")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Reshard SRC into DST: new mesh, placements, dtype or an HF export."""
    import os
    import subprocess
    import tempfile
    import time

    args = [src, dst, "--format", format, "--strategy", strategy, "--max-memory", max_memory,
            "--max-shard-size", max_shard_size]  # fmt: skip
    for flag, value in (("--mesh", mesh), ("--rules", rules), ("--dtype", dtype)):
        if value:
            args += [flag, value]
    if not checksum:
        args.append("--no-checksum")
    with tempfile.TemporaryDirectory() as tmp, _bar(as_json) as bar:
        task = bar.add_task("converting", total=None, tensors="")
        progress_file = os.path.join(tmp, "progress.jsonl")
        if workers == 1:
            from reshard_svc.worker import main as worker_main

            code = worker_main(["convert", *args, "--progress-file", progress_file])
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={workers}", "-m", "reshard_svc.worker", "convert", *args,
                   "--progress-file", progress_file]  # fmt: skip
            proc = subprocess.Popen(cmd)
            while proc.poll() is None:
                _show(bar, task, progress_file)
                time.sleep(0.2)
            code = proc.returncode
        last = _show(bar, task, progress_file)
    if code != 0 or last.get("event") != "done":
        err.print(
            f"[bold red]error:[/] {last.get('error', f'workers exited with {code}')}",
            highlight=False,
        )
        raise typer.Exit(2)
    if as_json:
        sys.stdout.write(json.dumps(last) + "\n")
    else:
        out.print(
            f"[green]converted[/] {src} -> {dst}: {last['tensors']} tensors, "
            f"{_size(last['bytes_written'])} written in {last['seconds']} s ({last['strategy']})",
            highlight=False,
        )


def _show(bar: Progress, task: Any, path: str) -> dict[str, Any]:
    """Update the bar from the newest progress line; return that line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return {}
    if not lines:
        return {}
    last: dict[str, Any] = json.loads(lines[-1])
    for line in reversed(lines):
        rec = json.loads(line)
        if rec.get("event") == "progress":
            bar.update(
                task,
                completed=rec["bytes_done"],
                total=rec["bytes_total"],
                tensors=f"{rec['tensors_done']}/{rec['tensors_total']} tensors",
            )
            break
    return last


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    return app(args=argv)


if __name__ == "__main__":
    main()
