"""How ``reshard convert`` runs a conversion on this machine, and shows its progress.

* ``--workers 1``: in this process, through the same :class:`Conversion` the workers run.
* ``--workers N``: N worker processes this CLI starts itself, with the environment torchrun
  gives its workers (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...): no
  torchrun agent importing torch first, so the fixed cost is one torch import per worker,
  in parallel. The workers die with this process (``PR_SET_PDEATHSIG``); if one fails the
  others are stopped; Ctrl-C or SIGTERM (to this process or to its whole process group)
  stops them cleanly, and they remove their staging data and the target's lease.

Progress is a bar on a terminal; elsewhere (a log, a pipe) or with ``--json``, a JSON line
on stderr every few seconds and at the end; never ANSI codes off a terminal.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from reshard_svc._process import free_port, set_pdeathsig
from reshard_svc.jobs.argv import worker_argv
from reshard_svc.jobs.environment import NODE_RANK_ENV, worker_env
from reshard_svc.jobs.events import done_event

__all__ = ["Outcome", "ProgressOut", "run_in_process", "run_workers", "leftovers"]

#: Seconds between JSON progress lines when stderr is not a terminal.
JSON_EVERY_S = 2.0
#: Seconds the other workers get to stop cleanly after one failed or on Ctrl-C.
STOP_GRACE_S = 20.0


class ProgressOut:
    """A progress bar on a terminal; JSON lines on stderr otherwise (or with ``as_json``)."""

    def __init__(self, console: Console, description: str, as_json: bool = False) -> None:
        self.console = console
        self.lines = as_json or not console.is_terminal
        self.bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(binary_units=True),  # MiB/GiB, as `reshard status` counts
            TransferSpeedColumn(),
            "{task.fields[tensors]}",
            TimeRemainingColumn(),
            console=console,
            transient=False,
            disable=self.lines,
        )
        self.task = self.bar.add_task(description, total=None, tensors="")
        self._last_line = 0.0
        self._pending: dict[str, Any] | None = None
        self._sent: dict[str, Any] | None = None

    def __enter__(self) -> ProgressOut:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)
        if self._pending is not None:
            self._emit(self._pending)

    def update(self, info: dict[str, Any], extra: str = "") -> None:
        """``info``: bytes_done/total, tensors_done/total (a progress event)."""
        tensors = f"{info['tensors_done']}/{info['tensors_total']} tensors"
        self.bar.update(
            self.task,
            completed=info["bytes_done"],
            total=info["bytes_total"] or None,
            tensors=tensors + (f" · {extra}" if extra else ""),
        )
        if self.lines:
            now = time.monotonic()
            event = {
                "event": "progress",
                **{
                    k: info[k]
                    for k in ("bytes_done", "bytes_total", "tensors_done", "tensors_total")
                },
            }
            if event == self._sent:
                return
            if now - self._last_line >= JSON_EVERY_S:
                self._emit(event)
            else:
                self._pending = event

    def _emit(self, event: dict[str, Any]) -> None:
        sys.stderr.write(json.dumps(event) + "\n")
        sys.stderr.flush()
        self._last_line = time.monotonic()
        self._pending, self._sent = None, event


@dataclass(kw_only=True)
class Outcome:
    """How a local run ended: rank 0's ``done`` event, or the error to print (once)."""

    done: dict[str, Any] | None = None
    error: str = ""
    interrupted: bool = False
    log_path: str = ""


def run_in_process(spec: Any, progress: ProgressOut) -> Outcome:
    """``--workers 1``: run the conversion here; library warnings print once, as warnings."""
    import logging

    from reshard_svc._collector import collector_paused
    from reshard_svc.errors import ReshardError

    with collector_paused(freeze=True):  # torch's import, without collections (as a worker)
        from reshard_svc.runtime.convert import Conversion

    started = time.time()
    with _warnings_to(progress.console):
        try:
            with collector_paused():
                result = Conversion(spec).run(lambda info: progress.update(info.to_json()))
        except KeyboardInterrupt:
            return Outcome(error="interrupted; nothing was committed", interrupted=True)
        except ReshardError as e:
            return Outcome(error=f"{type(e).__name__}: {e}")
        except Exception as e:  # a bug or the machine: one line, and the log has the rest
            logging.getLogger("reshard_client").debug("convert failed", exc_info=True)
            return Outcome(error=f"{type(e).__name__}: {e}")
    return Outcome(done=done_event(result, time.time() - started))


@contextlib.contextmanager
def _warnings_to(console: Console) -> Iterator[None]:
    """Library warnings as ``warning:`` lines (info stays quiet unless LOGLEVEL says)."""
    import logging

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            console.print(f"[yellow]warning:[/] {record.getMessage()}", highlight=False)

    root = logging.getLogger("reshard_svc")
    handler = Handler(level=os.environ.get("LOGLEVEL", "WARNING"))
    root.addHandler(handler)
    old, root.propagate = root.propagate, False
    previous = root.level
    root.setLevel(handler.level)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.propagate, root.level = old, previous


def _die_with_parent(parent: int) -> None:
    """In each worker before exec: die with this CLI (a parent gone already: exit now)."""
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def run_workers(spec: Any, progress: ProgressOut) -> Outcome:
    """``--workers N``: start N workers with torchrun's environment and follow them."""
    n = spec.workers
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="reshard-convert-")
    progress_file = os.path.join(tmp, "progress.jsonl")
    log_fd, log_path = tempfile.mkstemp(prefix="reshard-convert-", suffix=".log")
    base = worker_env(os.environ, parent_pid=os.getpid())
    base |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        NODE_RANK_ENV: "0",
    }
    cmd = [sys.executable, *worker_argv(spec, progress_file=progress_file)]
    procs: list[subprocess.Popen[bytes]] = []
    outcome = Outcome(log_path=log_path)
    try:
        with os.fdopen(log_fd, "wb") as log:
            for rank in range(n):
                env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        preexec_fn=functools.partial(_die_with_parent, os.getpid()),  # noqa: PLW1509
                    )
                )
            outcome = _follow(procs, progress, progress_file, log_path)
    except KeyboardInterrupt:
        _stop(procs)
        outcome = Outcome(
            error="interrupted; nothing was committed", interrupted=True, log_path=log_path
        )
        last = _last_events(progress_file)[1]
        if last and last.get("event") == "done":  # the commit landed before the stop
            outcome = Outcome(done=last, interrupted=True, log_path=log_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # our own scratch folder: the progress file
    return outcome


def _follow(
    procs: list[subprocess.Popen[bytes]],
    progress: ProgressOut,
    progress_file: str,
    log_path: str,
) -> Outcome:
    warnings = _WarningTail(log_path, progress.console)
    while True:
        codes = [p.poll() for p in procs]
        latest, final = _last_events(progress_file)
        if latest is not None:
            progress.update(latest)
        warnings.echo()
        failed = [c for c in codes if c not in (None, 0)]
        if failed and any(c is None for c in codes):
            _stop(procs)  # one worker failed: the others would wait on it in a collective
            continue
        if all(c is not None for c in codes):
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[0].wait(0.2)
    warnings.echo()
    latest, final = _last_events(progress_file)
    if all(c == 0 for c in codes) and final is not None and final.get("event") == "done":
        return Outcome(done=final, log_path=log_path)
    error = (final or {}).get("error") or warnings.first_error
    return Outcome(error=error or f"workers exited with codes {codes}", log_path=log_path)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the workers still running (they abort cleanly), SIGKILL after a grace."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _last_events(path: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(newest progress event, the done/error event) of rank 0's progress file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None, None
    latest = final = None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line still being written
        if event.get("event") == "progress":
            latest = event
        elif final is None:
            final = event
    return latest, final


class _WarningTail:
    """Echo rank 0's warnings from the workers' log (the rest of it stays in the file), and
    keep the first error a worker logged (a worker that failed before rank 0 could report:
    its error, not only its exit code, is what the user reads)."""

    LINE = re.compile(r" rank 0 WARNING ([\w.]+): (.*)$")
    ERROR = re.compile(r" rank \d+ ERROR reshard_svc\.worker: (rank \d+: .*)$")

    def __init__(self, path: str, console: Console) -> None:
        self.path, self.console, self.offset = path, console, 0
        self.first_error: str | None = None

    def echo(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # whole lines only; the rest next time
        self.offset += end
        for line in chunk[:end].decode("utf-8", "replace").splitlines():
            m = self.LINE.search(line)
            if m:
                self.console.print(f"[yellow]warning:[/] {m.group(2)}", highlight=False)
            e = self.ERROR.search(line)
            if e and self.first_error is None:
                self.first_error = e.group(1)


def leftovers(target: str) -> bool:
    """Whether an interrupted run left something at ``target`` that ``reshard gc``
    collects (a dead run's lease or staging data)."""
    try:
        from reshard_svc.format.collect import collect

        report = collect(target, dry_run=True)
    except Exception:  # cannot tell: say nothing rather than guess
        return False
    return bool(report)
