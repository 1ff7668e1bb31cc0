"""Commands that talk to a reshard-server: ``submit``, ``jobs``, ``audit``, ``status``,
``logs``, ``cancel``, ``wait``, ``watch``, ``watches``, ``unwatch``."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from rich.table import Table

from reshard_client.cli._app import (
    app,
    err,
    fail,
    out,
    size_text,
    spec_options,
)
from reshard_svc.jobs.spec import WORKERS

UrlOpt = Annotated[str | None, typer.Option("--url", envvar="RESHARD_URL", help="Server URL.")]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="RESHARD_TOKEN", help="Bearer token.", show_default=False),
]
TableJsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _client(url: str | None, token: str | None) -> Any:
    from reshard_client.client import ReshardClient

    return ReshardClient(url, token)


def _remote(fn: Any) -> Any:
    """Run a remote call; client errors become a one-line message and exit code 2."""
    from reshard_client.errors import ReshardClientError

    try:
        return fn()
    except ReshardClientError as e:
        raise fail(e) from None


def _wait_with_bar(client: Any, job_id: str, as_json: bool) -> Any:
    """Follow a job (a bar on a terminal, JSON lines otherwise). Ctrl-C stops following,
    not the job, and says so."""
    from reshard_client.runner import ProgressOut

    with ProgressOut(err, f"job {job_id}", as_json) as progress:

        def show(job: Any) -> None:
            extra = job.state.value + (f" ({job.reason})" if job.reason else "")
            progress.update(job.progress.model_dump(), extra)

        try:
            return client.wait(job_id, on_progress=show, poll=0.3)
        except KeyboardInterrupt:
            err.print(
                f"job {job_id} keeps running; `reshard cancel {job_id}` stops it", highlight=False
            )
            raise typer.Exit(130) from None


def _print_job(job: Any, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(job.model_dump_json(indent=1) + "\n")
        return
    p = job.progress
    out.print(
        f"[bold]{job.id}[/]  {job.state.value}  {job.source} -> {job.target}", highlight=False
    )
    out.print(
        f"  progress {size_text(p.bytes_done)} / {size_text(p.bytes_total)}, "
        f"{p.tensors_done}/{p.tensors_total} tensors; attempts {job.attempts}",
        highlight=False,
    )
    if job.reason:
        out.print(f"  waiting: {job.reason}", highlight=False)
    if job.error:
        out.print(f"  [red]error:[/] {job.error}", highlight=False)


WorkersOpt = Annotated[int | None, typer.Option(min=1, help=WORKERS.help)]


def _job_options(workers: int | None, options: dict[str, Any]) -> dict[str, Any]:
    """The conversion options of a job body (files are read here: a rules or rename YAML is
    this machine's); those not given are left out, for the server's defaults."""
    from reshard_svc.errors import ReshardError
    from reshard_svc.jobs.spec import options_from_text

    try:
        values = options_from_text(options)
    except ReshardError as e:
        raise fail(e) from None
    return values if workers is None else {**values, "workers": workers}


@app.command()
@spec_options(placement=True)
def submit(
    src: Annotated[str, typer.Argument(help="Source checkpoint URI (under the server's roots).")],
    dst: Annotated[str, typer.Argument(help="Target URI (under the server's roots).")],
    *,
    workers: WorkersOpt = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Submit at most once per key.")
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Follow progress until the job ends.")
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the job as JSON.")] = False,
    **options: Any,
) -> None:
    """Submit a conversion job to reshard-server."""
    # The server sees only absolute paths: a relative one is this shell's, resolved here.
    spec = {"source": _absolute(src), "target": _absolute(dst), **_job_options(workers, options)}
    _check_body("JobCreate", spec, "job")
    with _client(url, token) as client:
        job = _remote(lambda: client.submit(spec, idempotency_key=idempotency_key))
        if not as_json:
            err.print(f"submitted job {job.id} ({job.state.value})", highlight=False)
        if wait:
            job = _remote(lambda: _wait_with_bar(client, job.id, as_json))
        _print_job(job, as_json)
    if wait and job.state.value != "succeeded":
        raise typer.Exit(1)


def _absolute(uri: str) -> str:
    """A local path as an absolute one (a URI with a scheme is left as it is)."""
    import os
    import re

    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", uri):
        return uri
    return os.path.abspath(os.path.expanduser(uri))


def _check_body(model: str, body: dict[str, Any], what: str) -> None:
    """Validate the body as the server will: a 422 becomes one ``error:`` line here."""
    from pydantic import ValidationError

    from reshard_server import schemas

    try:
        getattr(schemas, model)(**body)
    except ValidationError as e:
        fields = "; ".join(f"{'.'.join(str(x) for x in d['loc'])}: {d['msg']}" for d in e.errors())
        err.print(f"[bold red]error:[/] invalid {what}: {fields}", highlight=False)
        raise typer.Exit(2) from None


@app.command()
def jobs(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    owner: Annotated[str | None, typer.Option(help="Admins: only this user's jobs.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500)] = 50,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: TableJsonOpt = False,
) -> None:
    """List your jobs, newest first (an admin sees everyone's)."""
    with _client(url, token) as client:
        page = _remote(lambda: client.list(state=state, limit=limit, owner=owner))
    if as_json:
        sys.stdout.write(page.model_dump_json(indent=1) + "\n")
        return
    table = Table(title=f"{page.total} job(s)", title_justify="left")
    for col in ("id", "owner", "state", "progress", "source", "target", "created"):
        table.add_column(col)
    for j in page.items:
        p = j.progress
        pct = f"{100 * p.bytes_done / p.bytes_total:.0f}%" if p.bytes_total else "-"
        state = f"{j.state.value} ({j.reason})" if j.reason else j.state.value
        table.add_row(
            j.id,
            j.owner or "-",
            state,
            pct,
            j.source,
            j.target,
            j.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    out.print(table)


@app.command()
def audit(
    user: Annotated[str | None, typer.Option("--user", help="Only this user's actions.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 100,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: TableJsonOpt = False,
) -> None:
    """The server's audit log, newest first: who submitted, cancelled or was refused what,
    when and from where (admins only)."""
    with _client(url, token) as client:
        page = _remote(lambda: client.audit(limit=limit, principal=user))
    if as_json:
        sys.stdout.write(page.model_dump_json(indent=1) + "\n")
        return
    table = Table(title=f"{len(page.items)} audit entries", title_justify="left")
    for col in ("when", "user", "action", "target", "outcome", "from"):
        table.add_column(col)
    for e in page.items:
        outcome = f"{e.outcome} {e.code}: {e.detail}" if e.code else e.outcome
        table.add_row(
            e.at.strftime("%Y-%m-%d %H:%M:%S"),
            e.principal or "(unknown)",
            e.action,
            e.target,
            outcome,
            e.address,
        )
    out.print(table)


@app.command()
def status(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: TableJsonOpt = False,
) -> None:
    """Show one job: state, progress, error."""
    with _client(url, token) as client:
        _print_job(_remote(lambda: client.get(job_id)), as_json)


@app.command()
def logs(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")
    ] = False,
    tail: Annotated[int | None, typer.Option(help="Only the last N lines.")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Print a job's worker logs."""
    import time

    from reshard_client.client import TERMINAL

    with _client(url, token) as client:
        chunk = _remote(lambda: client.logs(job_id, tail=tail))
        sys.stdout.write(chunk.text)
        offset = chunk.next_offset
        while follow:
            job = _remote(lambda: client.get(job_id))
            chunk = _remote(lambda at=offset: client.logs(job_id, offset=at))
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            offset = chunk.next_offset
            if job.state.value in TERMINAL and not chunk.text:
                break
            time.sleep(0.5)


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: TableJsonOpt = False,
) -> None:
    """Cancel a job (queued: at once; running: SIGTERM, then SIGKILL after a grace)."""
    with _client(url, token) as client:
        _print_job(_remote(lambda: client.cancel(job_id)), as_json)


@app.command("wait")
def wait_cmd(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: TableJsonOpt = False,
) -> None:
    """Follow a job's progress until it ends; exit 1 unless it succeeded."""
    with _client(url, token) as client:
        job = _remote(lambda: _wait_with_bar(client, job_id, as_json))
    _print_job(job, as_json)
    if job.state.value != "succeeded":
        raise typer.Exit(1)


@app.command()
@spec_options(placement=True)
def watch(
    root: Annotated[str, typer.Argument(help="Folder of step folders (under the server's roots).")],
    *,
    to: Annotated[
        str,
        typer.Option(
            "--to", help="Target of each step's job; holds {step}, e.g. /exports/hf-{step}."
        ),
    ],
    every: Annotated[int, typer.Option(min=1, help="Only steps divisible by K.", metavar="K")] = 1,
    existing: Annotated[
        bool, typer.Option("--existing", help="Also convert the steps already committed.")
    ] = False,
    workers: WorkersOpt = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the watch as JSON.")] = False,
    **options: Any,
) -> None:
    """Have reshard-server convert each step committed under ROOT from now on (step-N,
    step_N, iter_N, global_step_N, checkpoint-N folders of reshard, torch DCP or
    torch_checkpointing): one job per step, never for a half-written one."""
    body = {
        "root": _absolute(root),
        "target": _absolute(to),
        "every": every,
        "existing": existing,
        **_job_options(workers, options),
    }
    _check_body("WatchCreate", body, "watch")
    with _client(url, token) as client:
        w = _remote(lambda: client.watch(body))
    if as_json:
        sys.stdout.write(w.model_dump_json(indent=1) + "\n")
        return
    skipped = sum(1 for s in w.steps if s.outcome == "existing")
    out.print(
        f"[bold]{w.id}[/]  watching {w.root} (every {w.every}) -> {w.target}", highlight=False
    )
    if skipped:
        out.print(
            f"  {skipped} step(s) already committed are left alone (--existing converts them)",
            highlight=False,
        )
    out.print(f"  `reshard unwatch {w.id}` stops it", highlight=False)


@app.command()
def watches(
    all: Annotated[bool, typer.Option("--all", help="Stopped watches too.")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: TableJsonOpt = False,
) -> None:
    """List the server's watches: root, target, the jobs submitted, the last step."""
    with _client(url, token) as client:
        page = _remote(lambda: client.watches(all=all))
    if as_json:
        sys.stdout.write(page.model_dump_json(indent=1) + "\n")
        return
    table = Table(title=f"{len(page.items)} watch(es)", title_justify="left")
    for col in ("id", "state", "root", "every", "target", "jobs", "last step", "error"):
        table.add_column(col)
    for w in page.items:
        last = next((s for s in w.steps if s.outcome != "existing"), None)
        shown = f"{last.step} ({last.job_id or last.outcome})" if last else "-"
        table.add_row(
            w.id, w.state, w.root, str(w.every), w.target, str(w.submitted), shown, w.error or ""
        )
    out.print(table)


@app.command()
def unwatch(
    watch_id: Annotated[str, typer.Argument(help="Watch id (`reshard watches`).")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: TableJsonOpt = False,
) -> None:
    """Stop a watch: no new jobs (the ones it submitted keep running)."""
    with _client(url, token) as client:
        w = _remote(lambda: client.unwatch(watch_id))
    if as_json:
        sys.stdout.write(w.model_dump_json(indent=1) + "\n")
        return
    out.print(f"{w.id} stopped; it submitted {w.submitted} job(s)", highlight=False)
