"""Local commands: ``inspect``, ``verify``, ``convert``, ``gc``, ``steps``, ``plan``; they
call reshard_svc directly."""

import contextlib
import json
import os
import signal
import sys
from typing import Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from reshard_client.cli._app import (
    app,
    err,
    fail,
    out,
    size_text,
    spec_options,
)

#: box colours, cycled (distinct on dark and light terminals)
PALETTE = (
    "red",
    "green",
    "blue",
    "magenta",
    "cyan",
    "yellow",
    "bright_red",
    "bright_green",
    "bright_blue",
    "bright_magenta",
    "bright_cyan",
    "dark_orange",
    "purple",
    "orchid",
    "turquoise2",
    "gold3",
)
LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def _draw_layout(index: Any, name: str, as_json: bool) -> None:
    from rich.text import Text

    from reshard_svc.format.picture import layout_picture

    meta = index.tensors.get(name)
    if meta is None:
        near = [n for n in sorted(index.tensors) if name.split(".")[-1] in n][:5]
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        from reshard_svc.errors import UsageError

        raise fail(
            UsageError(f"no tensor {name!r} in this checkpoint{hint} (reshard inspect lists them)")
        )
    pic = layout_picture(meta)
    if as_json:
        sys.stdout.write(json.dumps(pic, indent=1) + "\n")
        return
    boxes = pic["boxes"]
    out.print(
        f"[bold]{name}[/]  {pic['dtype']} {'x'.join(map(str, pic['shape'])) or 'scalar'}"
        f"  {pic['layout'] or '(no layout recorded: stored chunks)'}",
        highlight=False,
    )
    dims = pic["dims_drawn"]
    out.print(
        f"rows: dim {dims[0]}, columns: dim {dims[1]}"
        if len(dims) == 2
        else "one row: dim 0"
        if dims
        else "a scalar",
        highlight=False,
    )
    for row in pic["grid"]:
        line = Text()
        for k in row:
            label = LABELS[k % len(LABELS)] if k >= 0 else "?"
            line.append(label, style=f"bold white on {PALETTE[k % len(PALETTE)]}" if k >= 0 else "")
        out.print(line)
    if pic["note"]:
        out.print(pic["note"], highlight=False)
    for k, b in enumerate(boxes[:64]):
        where = "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(b["offsets"], b["sizes"])) + "]"
        if b["holders"]:
            who = "; ".join(",".join(f"{n}={v}" for n, v in c.items()) for c in b["coords"])
            held = (
                f"rank {b['holders'][0]}"
                if len(b["holders"]) == 1
                else f"{len(b['holders'])} replicas: ranks {', '.join(map(str, b['holders'][:8]))}"
                + ("…" if len(b["holders"]) > 8 else "")
            )
            text = f"{where}  {held}  ({who[:200]})"
        else:
            text = f"{where}  {b.get('file', '')}"
        line = Text()
        line.append(
            f" {LABELS[k % len(LABELS)]} ", style=f"bold white on {PALETTE[k % len(PALETTE)]}"
        )
        line.append(" " + text)
        out.print(line)
    if len(boxes) > 64:
        out.print(f"… and {len(boxes) - 64} more boxes (--json lists them all)")


@app.command()
def inspect(
    uri: Annotated[str, typer.Argument(help="Checkpoint folder: path, file://, s3://, memory://")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the full description as JSON.")
    ] = False,
    layout: Annotated[
        str | None,
        typer.Option(
            "--layout",
            metavar="TENSOR",
            help="Draw TENSOR's layout: its boxes, coloured by the mesh coordinates "
            "that hold them (with --json: the picture's data).",
        ),
    ] = None,
) -> None:
    """Show a checkpoint's tensors: dtype, shape, layout, chunks and bytes."""
    from reshard_svc import ReshardError
    from reshard_svc import inspect as do_inspect
    from reshard_svc.format.inspection import describe_index

    try:
        index = do_inspect(uri)
    except ReshardError as e:
        raise fail(e) from None
    if layout is not None:
        return _draw_layout(index, layout, as_json)
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
            size_text(t.nbytes),
        )
    out.print(table)
    out.print(
        f"{len(index.tensors)} tensors, {size_text(index.total_bytes)} in {len(index.files)} files"
        + (f"; extras: {', '.join(sorted(index.extras))}" if index.extras else "")
        + (
            "; opaque items (kept as bytes, never unpickled): "
            + ", ".join(f"{k} ({size_text(b.nbytes)})" for k, b in sorted(index.blobs.items()))
            if index.blobs
            else ""
        )
    )


@app.command()
def verify(
    uri: Annotated[str, typer.Argument(help="Checkpoint folder to check end to end.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check sizes, headers, coverage and every block's CRC32C. Exit 1 on problems."""
    from reshard_svc import verify as do_verify

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),  # MiB/GiB, as `reshard status` counts
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
            raise fail(e) from None
    if as_json:
        sys.stdout.write(json.dumps(report.to_json(), indent=1) + "\n")
    elif report.complete:
        out.print(
            f"[green]ok[/] {uri}: {report.tensors} tensors, {report.files_checked} files, "
            f"{size_text(report.bytes_hashed)} checked ({report.checksum})",
            highlight=False,
        )
    elif report.ok:  # never "ok" for bytes nothing could check
        checked = f"{size_text(report.bytes_hashed)} checked, " if report.bytes_hashed else ""
        out.print(
            f"[yellow]no problems found[/] in what could be checked in {uri}: "
            f"{report.tensors} tensors, {report.files_checked} files (sizes, headers, "
            f"coverage); {checked}{size_text(report.bytes_unchecked)} of data NOT checked: "
            f"{'; '.join(report.unchecked)}",
            highlight=False,
        )
    else:
        for p in report.problems:
            err.print(f"[red]problem:[/] {p}", highlight=False)
        err.print(f"{len(report.problems)} problem(s) in {uri}", highlight=False)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
@spec_options(placement=False)
def convert(
    src: Annotated[
        str,
        typer.Argument(help="Source checkpoint (ours, HF, DCP, torch_checkpointing, Megatron)."),
    ],
    dst: Annotated[
        str, typer.Argument(help="Target folder: new, a checkpoint, or (hf) a model folder.")
    ],
    *,
    workers: Annotated[
        int, typer.Option(min=1, help="Worker processes (1 runs in this process).")
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    **options: Any,
) -> None:
    """Reshard SRC into DST: new mesh, placements, dtype or an HF export."""
    from reshard_client.runner import ProgressOut, leftovers, run_in_process, run_workers
    from reshard_svc.errors import ReshardError
    from reshard_svc.format.target import preflight
    from reshard_svc.jobs.spec import ConvertSpec, options_from_text

    try:
        values = options_from_text(options, placement=False)
        spec = ConvertSpec(source=src, target=dst, workers_per_node=workers, **values).checked()
        preflight(
            spec.source, spec.target, overwrite=spec.overwrite, model_folder=spec.format == "hf"
        )
    except ReshardError as e:
        raise fail(e) from None
    # SIGTERM (to this process or its group) stops the run as Ctrl-C does: cleanly.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with ProgressOut(err, "converting", as_json) as progress:
            run = run_in_process if workers == 1 else run_workers
            outcome = run(spec, progress)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if outcome.interrupted and outcome.done is None:
        hint = f"; `reshard gc {dst}` removes what it left" if leftovers(dst) else ""
        err.print(
            f"[bold red]error:[/] interrupted: nothing was committed to {dst}{hint}"
            f"{_worker_log(outcome.log_path)}",
            highlight=False,
        )
        raise typer.Exit(130)
    _report(outcome, f"{src} -> {dst}", as_json)


def _worker_log(path: str) -> str:
    """ " (worker logs: PATH)" for a failed run whose workers wrote something; an empty
    log is removed, not named."""
    if not path:
        return ""
    with contextlib.suppress(OSError):
        if os.path.getsize(path) == 0:
            os.unlink(path)
            return ""
    return f" (worker logs: {path})" if os.path.exists(path) else ""


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _report(outcome: Any, what: str, as_json: bool) -> None:
    """The one line (or JSON) a conversion ends with, printed once; a failure of workers
    names their log (kept only then)."""
    done = outcome.done
    if done is None:
        err.print(
            f"[bold red]error:[/] {outcome.error}{_worker_log(outcome.log_path)}", highlight=False
        )
        raise typer.Exit(2)
    if outcome.log_path:
        with contextlib.suppress(OSError):
            os.unlink(outcome.log_path)
    if as_json:
        sys.stdout.write(json.dumps(done) + "\n")
        return
    cast = ""
    if done.get("cast") or done.get("kept"):
        cast = f"; {done.get('cast', 0)} cast, {done.get('kept', 0)} kept their dtype"
    if done.get("dequantized"):
        cast += f", {done['dequantized']} FP8 weights dequantized"
    note = " (interrupted after the commit: it is complete)" if outcome.interrupted else ""
    out.print(
        f"[green]converted[/] {what}: {done['tensors']} tensors, "
        f"{size_text(done['bytes_written'])} written in {done['seconds']} s ({done['strategy']})"
        f"{cast}{note}",
        highlight=False,
    )


@app.command()
def gc(
    uri: Annotated[str, typer.Argument(help="Checkpoint folder whose leftovers to collect.")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only say what would be removed or finished.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Remove what interrupted saves and converts into URI left behind.

    Only runs whose lease is stale are touched (expired, or held by a process of this host
    that is gone); a run still in progress is left alone. An interrupted local commit is
    rolled forward (or back). Files that are not part of a checkpoint are never deleted.
    """
    from reshard_svc.errors import ReshardError
    from reshard_svc.format.collect import collect

    try:
        report = collect(uri, dry_run=dry_run)
    except ReshardError as e:
        raise fail(e) from None
    if as_json:
        sys.stdout.write(json.dumps(report.to_json()) + "\n")
        return
    verb = "would " if dry_run else ""
    for path in report.removed:
        out.print(f"{verb}remove  {path}", highlight=False)
    for path in report.rolled_forward:
        out.print(f"{verb}finish  {path} (a decided commit)", highlight=False)
    for path in report.rolled_back:
        out.print(f"{verb}restore {path} (an unfinished commit)", highlight=False)
    for path in report.kept:
        out.print(f"kept    {path}: holds files that are not ours to delete", highlight=False)
    for token in report.live:
        out.print(f"skipped run {token}: still in progress (its lease is live)", highlight=False)
    if not (report or report.kept or report.live):
        from reshard_svc.storage import open_storage

        if open_storage(uri).root_kind() == "missing":
            err.print(
                f"[bold red]error:[/] {uri} does not exist and nothing was left beside it: "
                "check the path",
                highlight=False,
            )
            raise typer.Exit(2)
        out.print(f"nothing to collect at {uri}", highlight=False)


@app.command()
def steps(
    root: Annotated[str, typer.Argument(help="A CheckpointManager root (step-N folders).")],
    keep_last: Annotated[
        int | None, typer.Option(min=1, help="Retention: keep the newest N committed steps.")
    ] = None,
    keep_every: Annotated[
        int | None, typer.Option(min=1, help="Retention: also keep every step divisible by M.")
    ] = None,
    fast: Annotated[
        str | None,
        typer.Option(help="Also this node's fast path (a FastTier's): the fast steps it holds."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the steps as JSON.")] = False,
) -> None:
    """List the step folders under ROOT: committed or partial, size, age, and what a
    retention policy (--keep-last, --keep-every) would keep; with --fast, the fast tier's
    steps on this node too. Changes nothing."""
    from reshard_svc.errors import ReshardError
    from reshard_svc.sessions.steps import list_steps

    try:
        rows = list_steps(root, keep_last=keep_last, keep_every=keep_every, fast=fast)
    except ReshardError as e:
        raise fail(e) from None
    if as_json:
        sys.stdout.write(json.dumps({"root": root, "steps": [r.to_json() for r in rows]}) + "\n")
        return
    if not rows:
        out.print(f"no step folders under {root}", highlight=False)
        return
    table = Table(title=root, title_justify="left")
    for col in ("step", "tier", "state", "size", "age", "retention"):
        table.add_column(col, justify="right" if col in ("step", "size", "age") else "left")
    for r in rows:
        age = (
            "-"
            if r.age_s is None
            else f"{r.age_s / 60:.0f} min"
            if r.age_s >= 60
            else f"{r.age_s:.0f} s"
        )
        table.add_row(
            str(r.step),
            r.tier,
            "committed" if r.committed else "partial",
            size_text(r.bytes),
            age,
            r.policy or "-",
        )
    out.print(table)


@app.command()
@spec_options(placement=False)
def plan(
    src: Annotated[str, typer.Argument(help="Source checkpoint (any format reshard reads).")],
    *,
    world: Annotated[
        int | None,
        typer.Option(
            min=1, help="Workers to plan for (default: the mesh's size with --load, else 1)."
        ),
    ] = None,
    load: Annotated[
        bool,
        typer.Option(
            "--load", help="Size reshard_svc.load on the mesh's ranks instead of a convert."
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the plan's figures as JSON.")
    ] = False,
    **options: Any,
) -> None:
    """A dry run: plan converting SRC (or loading it, --load) on --world workers, on this
    machine, and print what each worker would read, send and receive, its peak memory,
    the storage requests, waves and strategy. Reads the source's index only; takes
    convert's options."""
    from reshard_svc.errors import ReshardError
    from reshard_svc.jobs.spec import ConvertSpec, options_from_text
    from reshard_svc.runtime.dry_run import dry_run

    try:
        values = options_from_text(options, placement=False)
        spec = ConvertSpec(source=src, target=src.rstrip("/") + ".plan", **values).checked()
        report = dry_run(spec, world, load=load)
    except ReshardError as e:
        raise fail(e) from None
    if as_json:
        sys.stdout.write(json.dumps(report.to_json()) + "\n")
        return
    out.print(
        f"[bold]{report.mode}[/] of {src} on {report.world} worker(s): {report.strategy}, "
        f"{report.tensors} tensors, {size_text(report.bytes_total)} delivered, {report.waves} "
        f"wave(s), {report.storage_requests} storage requests (planned in {report.plan_s} s)",
        highlight=False,
    )
    table = Table(title_justify="left")
    for col in ("per worker", "max", "mean", "max/mean"):
        table.add_column(col, justify="left" if col == "per worker" else "right")
    for label, spread in (
        ("read from storage", report.read),
        ("sent", report.sent),
        ("received", report.received),
        (f"peak in flight (budget {size_text(report.budget)})", report.peak_memory),
    ):
        table.add_row(
            label, size_text(spread.max), size_text(int(spread.mean)), f"{spread.max_over_mean:.2f}"
        )
    out.print(table)
